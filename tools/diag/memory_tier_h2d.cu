// How a memory tier's objects best reach paged GPU blocks: the choices for issue 46, measured on one
// card in one run. A tmpfs file stands in for the memory tier (mapped shared, registered with
// CUDA); its objects go to scattered places of a device buffer (paged KV blocks) by
//   contiguous  one cudaMemcpyAsync of the whole file (the copy engine's limit, no scatter)
//   per_copy    one cudaMemcpyAsync per object (the host issues each)
//   batch       one cudaMemcpyBatchAsync per layer's objects (CUDA 12.8+: one call, the driver
//               splits the work over the copy engines)
//   sm_loads    a kernel whose warps load each object from the mapping over PCIe and store it
//               (today's mapped path, without the checksum), on 8, 16 and 32 thread blocks
// Each reports GB/s over --rounds rounds and the host time of the issuing call(s).
//
//   nvcc -O2 -arch=sm_90 -o /tmp/mt tools/diag/memory_tier_h2d.cu -lcuda
//   /tmp/mt /dev/shm/mt.pool 2048 524288   # file MiB, object bytes
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                             \
  do {                                                                                    \
    cudaError_t e = (x);                                                                  \
    if (e != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// One warp per object at a time: 16-byte loads from the mapped host pages, stores to the device.
__global__ void sm_copy(const uint4* const* src, uint4* const* dst, size_t words, size_t n) {
  const int lane = threadIdx.x % 32, warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int warps = gridDim.x * blockDim.x / 32;
  for (size_t o = warp; o < n; o += warps)
    for (size_t i = lane; i < words; i += 32) dst[o][i] = src[o][i];
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s FILE MIB OBJECT_BYTES [ROUNDS]\n", argv[0]);
    return 2;
  }
  const char* path = argv[1];
  const size_t bytes = std::strtoull(argv[2], nullptr, 10) << 20, obj = std::strtoull(argv[3], nullptr, 10);
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 5;
  const size_t n = bytes / obj;
  int fd = ::open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return std::perror(path), 1;
  auto* map = static_cast<uint8_t*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0));
  if (map == MAP_FAILED) return std::perror("mmap"), 1;
  std::memset(map, 0x5a, bytes);
  CK(cudaHostRegister(map, bytes, cudaHostRegisterMapped));
  uint8_t* dmap;
  CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dmap), map, 0));
  uint8_t* dev;
  CK(cudaMalloc(&dev, bytes));
  // Objects land in a random permutation of the device's object-sized places (paged blocks).
  std::vector<size_t> place(n);
  std::iota(place.begin(), place.end(), 0);
  std::shuffle(place.begin(), place.end(), std::mt19937_64(7));
  std::vector<void*> dsts(n);
  std::vector<const void*> srcs(n), dsrcs(n);
  std::vector<size_t> sizes(n, obj);
  for (size_t i = 0; i < n; ++i) {
    dsts[i] = dev + place[i] * obj;
    srcs[i] = map + i * obj;
    dsrcs[i] = dmap + i * obj;
  }
  void **d_dsts, **d_srcs;
  CK(cudaMalloc(&d_dsts, n * sizeof(void*)));
  CK(cudaMalloc(&d_srcs, n * sizeof(void*)));
  CK(cudaMemcpy(d_dsts, dsts.data(), n * sizeof(void*), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_srcs, dsrcs.data(), n * sizeof(void*), cudaMemcpyHostToDevice));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("{\"device\": \"%s\", \"file_mib\": %zu, \"object_bytes\": %zu, \"objects\": %zu, \"results\": [\n",
              prop.name, bytes >> 20, obj, n);
  bool first = true;
  auto run = [&](const char* name, auto issue) {
    issue();  // warm
    CK(cudaStreamSynchronize(s));
    double host = 0, t0 = now();
    for (int r = 0; r < rounds; ++r) {
      double h0 = now();
      issue();
      host += now() - h0;
    }
    CK(cudaStreamSynchronize(s));
    double t = now() - t0;
    std::printf("%s  {\"method\": \"%s\", \"gb_s\": %.2f, \"host_us_per_round\": %.1f}", first ? "" : ",\n", name,
                bytes * rounds / t / 1e9, host / rounds * 1e6);
    first = false;
  };
  run("contiguous", [&] { CK(cudaMemcpyAsync(dev, map, bytes, cudaMemcpyHostToDevice, s)); });
  run("per_copy", [&] {
    for (size_t i = 0; i < n; ++i) CK(cudaMemcpyAsync(dsts[i], srcs[i], obj, cudaMemcpyHostToDevice, s));
  });
#if CUDART_VERSION >= 12080
  run("batch", [&] {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0;
#if CUDART_VERSION >= 13000
    CK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &idx, 1, s));
#else
    size_t fail = 0;
    CK(cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), n, &attr, &idx, 1, &fail, s));
#endif
  });
#endif
  for (int blocks : {8, 16, 32}) {
    char name[32];
    std::snprintf(name, sizeof(name), "sm_loads_%d", blocks);
    run(name, [&] {
      sm_copy<<<blocks, 512, 0, s>>>(reinterpret_cast<const uint4* const*>(d_srcs), reinterpret_cast<uint4* const*>(d_dsts),
                                    obj / 16, n);
    });
  }
  std::printf("\n]}\n");
  CK(cudaHostUnregister(map));
  ::munmap(map, bytes);
  ::close(fd);
  ::unlink(path);
  return 0;
}
