// The CUDA backend: the I/O kernel on a green-context SM partition, rings and staging in mapped
// pinned host memory, stream-ordered issue and completion.
//
// The kernels are in io_kernel.cuh; this file is the host side: setup, the per-request arrays, the
// launches and the copy engine's stage (copy_stage.h).
//
// Commit headers are not the kernel's: the store writes a unit's header once every layer of it is
// on storage (UnitStore::commit_units).
//
// The driver API (green contexts exist only there on CUDA 13.0) is resolved at run time through
// cudaGetDriverEntryPointByVersion: the module links no libcuda and imports on hosts without a GPU.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <sys/mman.h>

#include <cuda/atomic>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"
#include "copy_stage.h"
#include "io_kernel.cuh"
#include "tutti/crc32c.h"

namespace tutti {

namespace {

std::string cuda_msg(const char* what, cudaError_t e) { return std::string(what) + ": " + cudaGetErrorString(e); }

struct Driver {
  PFN_cuDeviceGet_v2000 DeviceGet = nullptr;
  PFN_cuDeviceGetDevResource_v12040 DeviceGetDevResource = nullptr;
  PFN_cuDevSmResourceSplitByCount_v12040 DevSmResourceSplitByCount = nullptr;
  PFN_cuDevResourceGenerateDesc_v12040 DevResourceGenerateDesc = nullptr;
  PFN_cuGreenCtxCreate_v12040 GreenCtxCreate = nullptr;
  PFN_cuGreenCtxDestroy_v12040 GreenCtxDestroy = nullptr;
  PFN_cuCtxFromGreenCtx_v12040 CtxFromGreenCtx = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 GreenCtxStreamCreate = nullptr;
  PFN_cuCtxPushCurrent_v4000 CtxPushCurrent = nullptr;
  PFN_cuCtxPopCurrent_v4000 CtxPopCurrent = nullptr;
  PFN_cuStreamDestroy_v4000 StreamDestroy = nullptr;

  template <typename F>
  static bool get(const char* name, unsigned version, F* fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || p == nullptr)
      return false;
    *fn = reinterpret_cast<F>(p);
    return true;
  }
  bool load(std::string* missing) {
    bool ok = true;
    auto need = [&](bool got, const char* name) {
      if (!got) {
        ok = false;
        *missing += std::string(missing->empty() ? "" : ", ") + name;
      }
    };
    need(get("cuDeviceGet", 2000, &DeviceGet), "cuDeviceGet");
    need(get("cuDeviceGetDevResource", 12040, &DeviceGetDevResource), "cuDeviceGetDevResource");
    need(get("cuDevSmResourceSplitByCount", 12040, &DevSmResourceSplitByCount), "cuDevSmResourceSplitByCount");
    need(get("cuDevResourceGenerateDesc", 12040, &DevResourceGenerateDesc), "cuDevResourceGenerateDesc");
    need(get("cuGreenCtxCreate", 12040, &GreenCtxCreate), "cuGreenCtxCreate");
    need(get("cuGreenCtxDestroy", 12040, &GreenCtxDestroy), "cuGreenCtxDestroy");
    need(get("cuCtxFromGreenCtx", 12040, &CtxFromGreenCtx), "cuCtxFromGreenCtx");
    need(get("cuGreenCtxStreamCreate", 12050, &GreenCtxStreamCreate), "cuGreenCtxStreamCreate");
    need(get("cuCtxPushCurrent", 4000, &CtxPushCurrent), "cuCtxPushCurrent");
    need(get("cuCtxPopCurrent", 4000, &CtxPopCurrent), "cuCtxPopCurrent");
    need(get("cuStreamDestroy", 4000, &StreamDestroy), "cuStreamDestroy");
    return ok;
  }
};

// Device and mapped host arrays of one request slot, grown on demand and reused.
struct RequestMem {
  uint8_t* dev = nullptr;
  uint64_t dev_bytes = 0;
  uint8_t* host = nullptr;  // mapped pinned: [upload (dev_bytes)][sums_out][failed_out]
  uint64_t host_bytes = 0;
  cudaEvent_t uploaded = nullptr;
  // Current request.
  Ioctx* ctx = nullptr;
  Extent* extents = nullptr;
  uint64_t* expect = nullptr;
  uint8_t* failed = nullptr;
  uint64_t* sums_out = nullptr;    // host address
  uint8_t* failed_out = nullptr;   // host address
  uint32_t* pieces = nullptr;      // device: split objects' joined sums and pieces done
  uint32_t* copy_slot = nullptr;   // device: CopyStage's slot of each unit
  CopyStage copy;
  uint64_t nsums = 0;
  uint32_t units = 0;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, bool pair_io, bool trace, uint64_t copy_bytes)
      : device_(device), pair_io_(pair_io), print_trace_(trace), copy_bytes_(copy_bytes) {}
  ~CudaBackend() override {
    stop();
    for (void* m : registered_) cudaHostUnregister(m);  // a start() that failed half-way
  }

  Status init();
  std::string name() const override { return "cuda"; }
  bool host_agent_polls() const override { return true; }
  Status alloc_host(uint64_t bytes, void** ptr) override;
  void free_host(void* ptr, uint64_t bytes) override;
  uint32_t num_workers(uint32_t io_workers, uint32_t sms) const override {
    (void)io_workers;
    uint32_t s = std::max<uint32_t>(8, (sms + 7) / 8 * 8);
    return std::min<uint32_t>(s, std::max<uint32_t>(8, (num_sms_ - 8) / 8 * 8));
  }
  uint32_t num_queues(uint32_t workers) const override { return kLanes * workers; }
  uint64_t compute_stream() const override { return reinterpret_cast<uint64_t>(compute_stream_); }
  uint64_t copy_engine_bytes() const override { return copied_; }
  Status start(KernelContext* ctx, uint32_t workers) override;
  Status launch(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event) override;
  void stop() override;
  double kernel_cpu_seconds() const override { return 0; }
  Status begin_request(uint32_t id, RequestView* view) override;
  Status end_request(uint32_t id, RequestView* view) override;
  bool stream_wait(const uint32_t* ids, uint32_t n, uint64_t stream) override;
  Status record_on(uint64_t stream, uint64_t* event) override;
  Status scatter_from_host(uint32_t slot, const uint8_t* unit, const uint64_t* dst, const uint64_t* sums,
                           int64_t stream) override;
  Status scatter_wait(uint32_t slot, int64_t* bad) override;
  Status register_host(void* p, uint64_t n) override;
  void unregister_host(void* p) override;

 private:
  Status make_partition(uint32_t sms);
  void destroy_streams() {
    auto destroy = [this](cudaStream_t& s) {
      if (!s) return;
      if (green_) drv_.StreamDestroy(reinterpret_cast<CUstream>(s));
      else cudaStreamDestroy(s);
      s = nullptr;
    };
    for (cudaStream_t& s : io_streams_) destroy(s);
    destroy(scatter_stream_);
    destroy(copy_stream_);
    destroy(compute_stream_);
  }
  void push() {
    if (io_ctx_) drv_.CtxPushCurrent(io_ctx_);
  }
  void pop() {
    if (io_ctx_) {
      CUcontext c;
      drv_.CtxPopCurrent(&c);
    }
  }
  uint64_t dev_addr(const void* host) const {
    // Mapped host memory: the device address is the host address on UVA systems, which every
    // 64-bit CUDA platform is; kept as a function so that a non-UVA mapping would change one place.
    return reinterpret_cast<uint64_t>(host);
  }

  int device_;
  Driver drv_;
  int num_sms_ = 0;
  bool green_ = false;
  CUgreenCtx io_green_ = nullptr, compute_green_ = nullptr;
  CUcontext io_ctx_ = nullptr;
  cudaStream_t io_streams_[kLanes] = {}, compute_stream_ = nullptr;
  cudaStream_t scatter_stream_ = nullptr;  // the remote path's scatter kernel, on the I/O partition
  // The remote path (scatter_from_host), per scatter slot: device [dst][expect], mapped host
  // [dst][expect][bad], a mapped copy of a unit that is not in registered memory, and its events.
  struct ScatterSlot {
    uint8_t* dev = nullptr;
    uint8_t* host = nullptr;
    uint64_t host_bytes = 0;
    uint8_t* bounce = nullptr;
    cudaEvent_t order = nullptr;  // primary context: recorded on the caller's stream
    cudaEvent_t done = nullptr;   // after the scatter kernel, on scatter_stream_
  };
  std::mutex scatter_mu_;  // the slots' allocation and host_regions_
  ScatterSlot scatter_[kScatterSlots];
  std::vector<void*> host_regions_;  // register_host
  KernelContext* k_ = nullptr;
  uint32_t workers_ = 0, grid_ = 0, per_worker_ = 0;
  std::vector<cudaEvent_t> events_;
  cudaEvent_t order_event_ = nullptr;  // primary context, recorded on callers' streams (record_on)
  DevQueue* dev_queues_ = nullptr;
  uint64_t* dev_mapped_ = nullptr;     // device, per pool file: its registered mapping (map_memory)
  std::vector<void*> registered_;      // mapped pool files registered with CUDA
  uint32_t* counters_ = nullptr;
  CrcLaneTables* dev_crc_ = nullptr;
  uint32_t crc_xor_ = 0;
  uint32_t pieces_ = 1, piece_shift_[kPieces] = {};  // LaunchParams::pieces, piece_shift
  uint64_t* abort_ = nullptr;  // mapped host page
  unsigned long long* trace_ = nullptr;  // device counters, printed at stop() with cuda_trace
  bool pair_io_ = false;
  uint32_t window_ = 0;
  bool print_trace_ = false;
  uint64_t launches_ = 0, launch_calls_ = 0;
  std::vector<RequestMem> req_;
  bool vec16_ = false;
  uint32_t group_ = 1;  // IOCTXs per staging slot (2: K and V of a unit-layer as one I/O)
  // The copy engine's stage (copy_stage.h): two device buffers of copy_bytes_ / 2, taken in turn by
  // the launches that stage objects, each holding copy_units_ units' objects of one layer; the copy
  // stream; per buffer, its copy done (recorded on the copy stream) and its kernel done (on the
  // lane); bytes staged so far; the batch being built.
  static constexpr uint32_t kCopyBufs = 2;
  uint64_t copy_bytes_ = 0;
  uint8_t* copy_buf_[kCopyBufs] = {};
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t copied_ev_[kCopyBufs] = {}, read_ev_[kCopyBufs] = {};
  uint32_t copy_units_ = 0, copy_next_ = 0;
  uint64_t copied_ = 0;
  std::vector<void*> copy_dst_;
  std::vector<const void*> copy_src_;
  std::vector<size_t> copy_size_;
  int stage_copies(LaunchParams& p, const uint32_t* ids, cudaStream_t lane);
  // Shared memory of one I/O block: 3 + pieces_ words (the ready ring takes one per piece) and one
  // state byte per staging chunk.
  size_t smem_bytes() const { return sizeof(uint32_t) * (3 + pieces_) * per_worker_ + (per_worker_ + 3) / 4 * 4; }
  bool started_ = false;
};

Status CudaBackend::init() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return {Code::kDevice, cuda_msg("no usable CUDA device", e)};
  if (device_ < 0 || device_ >= count)
    return {Code::kDevice, "CUDA device " + std::to_string(device_) + " does not exist (" + std::to_string(count) + " found)"};
  if ((e = cudaSetDevice(device_)) != cudaSuccess) return {Code::kDevice, cuda_msg("cudaSetDevice", e)};
  if ((e = cudaFree(nullptr)) != cudaSuccess) return {Code::kDevice, cuda_msg("CUDA context", e)};
  int mapped = 0;
  cudaDeviceGetAttribute(&mapped, cudaDevAttrCanMapHostMemory, device_);
  int uva = 0;
  cudaDeviceGetAttribute(&uva, cudaDevAttrUnifiedAddressing, device_);
  if (!mapped || !uva) return {Code::kDevice, "device cannot map pinned host memory with unified addressing"};
  cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_);
  std::string missing;
  green_ = drv_.load(&missing);
  if (!green_ && (!drv_.CtxPushCurrent || !drv_.CtxPopCurrent)) drv_ = Driver{};
  return Status::Ok();
}

Status CudaBackend::alloc_host(uint64_t bytes, void** ptr) {
  // mmap, not cudaHostAlloc: io_uring registers anonymous memory on every kernel, while memory from
  // the NVIDIA device file is refused by some. Cacheable (not write-combined): the host reads rings.
  cudaSetDevice(device_);
  bytes = align_up(bytes);
  void* p = nullptr;
  Status st = map_host(bytes, &p);
  if (!st.ok()) return st;
  cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    unmap_host(p, bytes);
    return {Code::kDevice, cuda_msg("cudaHostRegister", e)};
  }
  void* dp = nullptr;
  e = cudaHostGetDevicePointer(&dp, p, 0);
  if (e != cudaSuccess || dp != p) {
    cudaHostUnregister(p);
    unmap_host(p, bytes);
    return {Code::kDevice, "mapped host memory has a device address other than its host address"};
  }
  *ptr = p;
  return Status::Ok();
}

void CudaBackend::free_host(void* ptr, uint64_t bytes) {
  if (!ptr) return;
  cudaHostUnregister(ptr);
  unmap_host(ptr, align_up(bytes));
}

Status CudaBackend::make_partition(uint32_t sms) {
  if (!green_) return {Code::kDevice, "green contexts unavailable"};
  CUdevice dev;
  if (drv_.DeviceGet(&dev, device_) != CUDA_SUCCESS) return {Code::kDevice, "cuDeviceGet failed"};
  CUdevResource all{};
  if (drv_.DeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS)
    return {Code::kDevice, "cuDeviceGetDevResource failed"};
  CUdevResource group{}, rest{};
  unsigned int ng = 1;
  CUresult r = drv_.DevSmResourceSplitByCount(&group, &ng, &all, &rest, 0, sms);
  if (r != CUDA_SUCCESS || ng != 1) return {Code::kDevice, "cuDevSmResourceSplitByCount(" + std::to_string(sms) + ") failed"};
  CUdevResourceDesc d_io = nullptr, d_rest = nullptr;
  if (drv_.DevResourceGenerateDesc(&d_io, &group, 1) != CUDA_SUCCESS ||
      drv_.DevResourceGenerateDesc(&d_rest, &rest, 1) != CUDA_SUCCESS)
    return {Code::kDevice, "cuDevResourceGenerateDesc failed"};
  if (drv_.GreenCtxCreate(&io_green_, d_io, dev, CU_GREEN_CTX_DEFAULT_STREAM) != CUDA_SUCCESS)
    return {Code::kDevice, "cuGreenCtxCreate (I/O partition) failed"};
  if (drv_.CtxFromGreenCtx(&io_ctx_, io_green_) != CUDA_SUCCESS) return {Code::kDevice, "cuCtxFromGreenCtx failed"};
  for (cudaStream_t* io : {&io_streams_[0], &io_streams_[1], &scatter_stream_, &copy_stream_}) {
    CUstream s = nullptr;
    if (drv_.GreenCtxStreamCreate(&s, io_green_, CU_STREAM_NON_BLOCKING, 0) != CUDA_SUCCESS)
      return {Code::kDevice, "cuGreenCtxStreamCreate (I/O) failed"};
    *io = reinterpret_cast<cudaStream_t>(s);
  }
  grid_ = group.sm.smCount;
  if (rest.sm.smCount > 0 && drv_.GreenCtxCreate(&compute_green_, d_rest, dev, CU_GREEN_CTX_DEFAULT_STREAM) == CUDA_SUCCESS) {
    CUstream cs = nullptr;
    if (drv_.GreenCtxStreamCreate(&cs, compute_green_, CU_STREAM_NON_BLOCKING, 0) == CUDA_SUCCESS)
      compute_stream_ = reinterpret_cast<cudaStream_t>(cs);
  }
  return Status::Ok();
}

// A scatter slot's device arrays: each object's destination block addresses, then each object's
// expected checksum; the slot's mapped host copy has one verdict byte per object after them.
uint64_t scatter_dev_bytes(const Geometry& g) {
  return (static_cast<uint64_t>(g.num_objs()) * g.unit_blocks + g.num_objs()) * 8;
}

Status CudaBackend::start(KernelContext* ctx, uint32_t workers) {
  k_ = ctx;
  workers_ = workers;
  cudaSetDevice(device_);
  const uint32_t nq = num_queues(workers);
  if (ctx->queues.size() != nq) return {Code::kDevice, "CUDA backend expects one SQ/CQ pair per worker and lane"};
  per_worker_ = ctx->num_chunks / nq;
  if (per_worker_ == 0) return {Code::kConfig, "staging too small: no chunk per I/O thread block"};
  if (per_worker_ > kMaxChunksPerWorker)
    return {Code::kConfig, "staging too large: " + std::to_string(per_worker_) + " chunks per I/O thread block (at most " +
                               std::to_string(kMaxChunksPerWorker) + ")"};
  Status st = make_partition(workers);
  if (!st.ok()) {
    // No green contexts (older driver): the kernel still runs, on a stream of the whole device.
    destroy_streams();  // any a failed partition made
    green_ = false;
    io_ctx_ = nullptr;
    for (cudaStream_t* io : {&io_streams_[0], &io_streams_[1], &scatter_stream_, &copy_stream_}) {
      cudaError_t e = cudaStreamCreateWithFlags(io, cudaStreamNonBlocking);
      if (e != cudaSuccess) return {Code::kDevice, cuda_msg("cudaStreamCreate", e)};
    }
    grid_ = workers;
  }
  if (grid_ > workers) grid_ = workers;  // one block per SQ/CQ pair
  // Objects and pointers 16-byte aligned: the kernel moves 16-byte vectors.
  vec16_ = ctx->geom.block_bytes % 16 == 0 && ctx->chunk_bytes % 16 == 0;
  for (const LayerKV& l : ctx->extents->layers()) {
    vec16_ = vec16_ && l.block_stride % 16 == 0;
    for (uint32_t i = 0; i < l.nptr; ++i) vec16_ = vec16_ && l.ptr[i] % 16 == 0;
  }
  // K and V of one unit and layer are adjacent in the GPU file: with one object per chunk, two
  // adjacent chunks can take both in one storage I/O. Off unless cuda_pair (TUTTI_CUDA_PAIR=1): on the H200 host
  // it made retrieves slower (640K tokens through 64 MiB of staging: 19.4 against 26.1 GB/s) and
  // did not speed up stores (docs/perf/2026-11-30-h200-cuda-morning.md, "K and V as one I/O").
  group_ = pair_io_ && ctx->geom.objs_per_layer == 2 && ctx->chunk_bytes == ctx->geom.obj_bytes && per_worker_ >= 4 ? 2 : 1;
  // The agent keeps at most queue_depth I/Os in flight, so the blocks of both lanes together keep
  // at most twice that many slots in use: one half in storage, the other being gathered or
  // scattered. More would only wait in the SQ. The free slots are a stack, so a block reuses the
  // slots it freed last and the staging it touches stays small enough for the CPU's last-level
  // cache (PCIe writes land there); on the H200 host this lifted the /dev/shm store at 128K tokens
  // from 24-26 to 35-38 GB/s with a 2 GiB staging area (docs/perf/2026-11-30-h200-cuda-afternoon.md,
  // "A window of staging").
  const uint32_t per_block = (kWindowQd * ctx->queue_depth + kLanes * grid_ - 1) / (kLanes * grid_);
  window_ = std::clamp<uint32_t>(per_block, 1, per_worker_ / group_);
  const uint32_t nk = kLanes * workers;  // SQ/CQ pairs of the kernel
  std::vector<DevQueue> qs(nk);
  for (uint32_t w = 0; w < nk; ++w) {
    const QueuePair& q = ctx->queues[w];
    qs[w] = DevQueue{q.sq_ctl, q.sq, q.cq_ctl, q.cq, q.depth};
  }
  cudaError_t e;
  if ((e = cudaMalloc(&dev_queues_, sizeof(DevQueue) * nk)) != cudaSuccess) return {Code::kDevice, cuda_msg("cudaMalloc", e)};
  // Mapped pool files (map_memory): pinned and mapped into the device, so that the kernel's workers
  // load and store their objects over PCIe, with no SQE, no staging and no host copy.
  std::vector<uint64_t> maps(ctx->mapped.size(), 0);
  for (size_t i = 0; i < ctx->mapped.size(); ++i) {
    if (!ctx->mapped[i]) continue;
    e = cudaHostRegister(ctx->mapped[i], ctx->mapped_bytes[i], cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e != cudaSuccess) {  // the file stays on the io_uring path
      cudaGetLastError();
      std::fprintf(stderr, "tutti: %s: its objects go through io_uring\n",
                   cuda_msg("cannot register a mapped pool file with CUDA", e).c_str());
      ctx->mapped[i] = nullptr;
      continue;
    }
    registered_.push_back(ctx->mapped[i]);
    void* d = nullptr;
    if ((e = cudaHostGetDevicePointer(&d, ctx->mapped[i], 0)) != cudaSuccess)
      return {Code::kDevice, cuda_msg("cudaHostGetDevicePointer (mapped pool file)", e)};
    maps[i] = reinterpret_cast<uint64_t>(d);
  }
  const uint64_t stride = static_cast<uint64_t>(ctx->geom.objs_per_layer) * ctx->geom.obj_bytes;
  copy_units_ = registered_.empty() || !stride ? 0 : static_cast<uint32_t>(std::min<uint64_t>(copy_bytes_ / kCopyBufs / stride, UINT32_MAX));
  for (uint32_t b = 0; b < kCopyBufs && copy_units_; ++b)
    if ((e = cudaMalloc(&copy_buf_[b], copy_units_ * stride)) != cudaSuccess)
      return {Code::kDevice, "copy_engine_mb (" + std::to_string(copy_bytes_ >> 20) + " MiB) of device memory for the copy " +
                                 "engine's stage: " + cudaGetErrorString(e) + "; a smaller copy_engine_mb, or 0, avoids it"};
  if (!registered_.empty()) {
    if ((e = cudaMalloc(&dev_mapped_, sizeof(uint64_t) * maps.size())) != cudaSuccess) return {Code::kDevice, cuda_msg("cudaMalloc", e)};
    if ((e = cudaMemcpy(dev_mapped_, maps.data(), sizeof(uint64_t) * maps.size(), cudaMemcpyHostToDevice)) != cudaSuccess)
      return {Code::kDevice, cuda_msg("cudaMemcpy", e)};
  }
  if ((e = cudaMemcpy(dev_queues_, qs.data(), sizeof(DevQueue) * nk, cudaMemcpyHostToDevice)) != cudaSuccess)
    return {Code::kDevice, cuda_msg("cudaMemcpy", e)};
  {
    std::unique_ptr<CrcLaneTables> tables(new CrcLaneTables());
    crc32c_lane_tables(tables.get());
    crc_xor_ = crc32c_zeros_xor(ctx->geom.obj_bytes);
    // Pieces of whole blocks and whole 512-byte strides of the lane scheme, where the shared memory
    // of a fourfold ready ring is small.
    const uint64_t piece = ctx->geom.obj_bytes / kPieces;
    pieces_ = ctx->geom.obj_bytes % kPieces == 0 && piece % ctx->geom.block_bytes == 0 && piece % 512 == 0 &&
                      per_worker_ <= 2048 ? kPieces : 1;
    for (uint32_t k = 0; k < kPieces; ++k) piece_shift_[k] = crc32c_x8n(k * piece);
    if ((e = cudaMalloc(&dev_crc_, sizeof(CrcLaneTables))) != cudaSuccess) return {Code::kDevice, cuda_msg("cudaMalloc", e)};
    if ((e = cudaMemcpy(dev_crc_, tables.get(), sizeof(CrcLaneTables), cudaMemcpyHostToDevice)) != cudaSuccess)
      return {Code::kDevice, cuda_msg("cudaMemcpy", e)};
  }
  if ((e = cudaMalloc(&counters_, sizeof(uint32_t) * 2 * ctx->num_iocbs)) != cudaSuccess)
    return {Code::kDevice, cuda_msg("cudaMalloc", e)};
  cudaMemset(counters_, 0, sizeof(uint32_t) * 2 * ctx->num_iocbs);
  if ((e = cudaMalloc(&trace_, 4 * sizeof(unsigned long long))) != cudaSuccess) return {Code::kDevice, cuda_msg("cudaMalloc", e)};
  cudaMemset(trace_, 0, 4 * sizeof(unsigned long long));
  void* a = nullptr;
  st = alloc_host(kAlign, &a);
  if (!st.ok()) return st;
  abort_ = static_cast<uint64_t*>(a);
  *abort_ = 0;
  if ((e = cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming)) != cudaSuccess)
    return {Code::kDevice, cuda_msg("cudaEventCreate", e)};
  push();
  events_.assign(ctx->num_iocbs, nullptr);
  for (auto& ev : events_)
    if ((e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) != cudaSuccess) {
      pop();
      return {Code::kDevice, cuda_msg("cudaEventCreate", e)};
    }
  for (uint32_t b = 0; b < kCopyBufs && copy_units_; ++b)  // the I/O context: recorded on its streams
    if ((e = cudaEventCreateWithFlags(&copied_ev_[b], cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&read_ev_[b], cudaEventDisableTiming)) != cudaSuccess) {
      pop();
      return {Code::kDevice, cuda_msg("cudaEventCreate (copy engine)", e)};
    }
  const size_t smem = smem_bytes();  // beside the kernel's static shared memory (the CRC tables)
  if (smem + 26 * 1024 > 48 * 1024 &&
      (e = cudaFuncSetAttribute(io_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem))) != cudaSuccess) {
    pop();
    return {Code::kConfig, cuda_msg("staging too large for the I/O kernel's shared memory", e)};
  }
  // Load both kernels now: with CUDA's lazy module loading the first launch would load them,
  // inside the engine's first layer call (0.3-1.5 ms of its CPU on the H200 host,
  // docs/perf/2026-12-01-crc32c-ab.md, "Lease 4").
  for (const void* fn : {reinterpret_cast<const void*>(io_kernel), reinterpret_cast<const void*>(scatter_kernel)}) {
    cudaFuncAttributes fa{};
    if ((e = cudaFuncGetAttributes(&fa, fn)) != cudaSuccess) {
      pop();
      return {Code::kDevice, cuda_msg("loading the I/O kernels", e)};
    }
  }
  for (ScatterSlot& sl : scatter_)  // the I/O context: recorded on scatter_stream_
    if ((e = cudaEventCreateWithFlags(&sl.done, cudaEventDisableTiming)) != cudaSuccess) {
      pop();
      return {Code::kDevice, cuda_msg("cudaEventCreate (scatter)", e)};
    }
  req_.assign(ctx->max_requests, RequestMem{});
  for (auto& m : req_) cudaEventCreateWithFlags(&m.uploaded, cudaEventDisableTiming);
  pop();
  // The rest of the remote path's scatter slots, now rather than at their first use, where
  // cudaHostRegister and cudaMalloc could make an asynchronous scatter wait for the device (the
  // bounce buffers stay lazy: only units outside registered memory need them). The primary
  // context, as before: `order` is recorded on callers' streams.
  {
    const Geometry& g = ctx->geom;
    const uint64_t dev_bytes = scatter_dev_bytes(g);
    const uint64_t host_bytes = align_up(dev_bytes + g.num_objs());
    for (ScatterSlot& sl : scatter_) {
      void* h = nullptr;
      if (!(st = alloc_host(host_bytes, &h)).ok()) return st;
      sl.host = static_cast<uint8_t*>(h);
      sl.host_bytes = host_bytes;
      if ((e = cudaMalloc(&sl.dev, dev_bytes)) != cudaSuccess ||
          (e = cudaEventCreateWithFlags(&sl.order, cudaEventDisableTiming)) != cudaSuccess)
        return {Code::kDevice, cuda_msg("scatter slot", e)};
    }
  }
  cudaDeviceSynchronize();
  started_ = true;
  return Status::Ok();
}

Status CudaBackend::begin_request(uint32_t id, RequestView* v) {
  RequestMem& m = req_[id];
  const Geometry& g = k_->geom;
  const uint64_t nctx = static_cast<uint64_t>(v->num_units) * g.objs_per_layer;
  const uint64_t next = nctx ? v->ctx[nctx - 1].extent_first + v->ctx[nctx - 1].extent_count : 0;
  const uint64_t nsums = static_cast<uint64_t>(v->num_units) * g.num_objs();
  auto al = [](uint64_t b) { return (b + 255) / 256 * 256; };
  const uint64_t o_ext = al(nctx * sizeof(Ioctx));
  const uint64_t o_exp = o_ext + al(next * sizeof(Extent));
  const uint64_t o_fail = o_exp + al(nsums * 8);
  const uint64_t o_copy = o_fail + al(v->num_units);
  const uint64_t o_pieces = o_copy + al(v->num_units * 4ull);
  const uint64_t dev_bytes = o_pieces + al(nsums * 8) + 256;
  const uint64_t host_bytes = dev_bytes + al(nsums * 8) + al(v->num_units) + 256;
  cudaSetDevice(device_);
  if (m.uploaded) cudaEventSynchronize(m.uploaded);  // the upload area of the last request is free
  if (dev_bytes > m.dev_bytes) {
    if (m.dev) cudaFree(m.dev);
    m.dev = nullptr;
    m.dev_bytes = 0;
    const uint64_t want = std::max<uint64_t>(dev_bytes, 2 * m.dev_bytes);
    cudaError_t e = cudaMalloc(&m.dev, want);
    if (e != cudaSuccess) return {Code::kDevice, cuda_msg("cudaMalloc (request arrays)", e)};
    m.dev_bytes = want;
  }
  if (host_bytes > m.host_bytes) {
    free_host(m.host, m.host_bytes);
    m.host = nullptr;
    m.host_bytes = 0;
    void* p = nullptr;
    const uint64_t want = align_up(std::max<uint64_t>(host_bytes, 2 * m.host_bytes));
    Status st = alloc_host(want, &p);
    if (!st.ok()) return st;
    m.host = static_cast<uint8_t*>(p);
    m.host_bytes = want;
  }
  uint8_t* up = m.host;
  std::memcpy(up, v->ctx, nctx * sizeof(Ioctx));
  std::memcpy(up + o_ext, v->extents, next * sizeof(Extent));
  std::memcpy(up + o_exp, v->checksums, nsums * 8);
  std::memcpy(up + o_fail, v->unit_failed, v->num_units);
  if (copy_units_)  // the stage's slots; without it (the default) the kernel never reads copy_slot
    m.copy.plan(v->ctx, v->num_units, g.objs_per_layer, k_->mapped, g.header_bytes, reinterpret_cast<uint32_t*>(up + o_copy));
  else
    m.copy = CopyStage{};
  m.ctx = reinterpret_cast<Ioctx*>(m.dev);
  m.extents = reinterpret_cast<Extent*>(m.dev + o_ext);
  m.expect = reinterpret_cast<uint64_t*>(m.dev + o_exp);
  m.failed = m.dev + o_fail;
  m.pieces = reinterpret_cast<uint32_t*>(m.dev + o_pieces);
  m.copy_slot = reinterpret_cast<uint32_t*>(m.dev + o_copy);
  m.sums_out = reinterpret_cast<uint64_t*>(m.host + al(dev_bytes));
  m.failed_out = m.host + al(dev_bytes) + al(nsums * 8);
  m.nsums = nsums;
  m.units = v->num_units;
  // Results start as the engine's view: expected sums stay put on retrieve, known misses stay failed.
  std::memcpy(m.sums_out, v->checksums, nsums * 8);
  std::memcpy(m.failed_out, v->unit_failed, v->num_units);
  push();
  cudaError_t e = cudaMemcpyAsync(m.dev, up, o_copy + v->num_units * 4ull, cudaMemcpyHostToDevice, io_streams_[0]);
  if (e == cudaSuccess && pieces_ > 1) e = cudaMemsetAsync(m.pieces, 0, nsums * 8, io_streams_[0]);
  if (e == cudaSuccess) e = cudaEventRecord(m.uploaded, io_streams_[0]);
  for (uint32_t l = 1; l < kLanes && e == cudaSuccess; ++l) e = cudaStreamWaitEvent(io_streams_[l], m.uploaded, 0);
  pop();
  if (e != cudaSuccess) return {Code::kDevice, cuda_msg("request upload", e)};
  return Status::Ok();
}

Status CudaBackend::end_request(uint32_t id, RequestView* v) {
  RequestMem& m = req_[id];
  // Every IOCB of the request is complete (the store waited on done_seq, which the kernel publishes
  // after fencing these words), so the mapped results can be read here.
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(v->checksums, m.sums_out, m.nsums * 8);
  // The kernel's flags are the causes finish reports per failed unit (1 an I/O error, 2 a checksum
  // mismatch); the errno of an I/O error stays with the agent (v->unit_errno is left 0: unknown).
  std::memcpy(v->unit_failed, m.failed_out, m.units);
  return Status::Ok();
}

Status CudaBackend::launch(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event) {
  if (!started_) return {Code::kDevice, "CUDA backend not started"};
  if (n == 0) return Status::Ok();
  const Geometry& g = k_->geom;
  uint32_t grid = grid_;
  if (sms && sms < grid) grid = std::max<uint32_t>(1, sms);
  push();
  cudaError_t e = cudaSuccess;
  const uint32_t lane = static_cast<uint32_t>(launch_calls_++ % kLanes);
  cudaStream_t stream = io_streams_[lane];
  if (event) e = cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(event), 0);
  for (uint32_t first = 0; first < n && e == cudaSuccess; first += kMaxLaunchIocbs) {
    LaunchParams p{};
    p.n = std::min(kMaxLaunchIocbs, n - first);
    p.chunks_per_worker = per_worker_;
    p.unit_blocks = g.unit_blocks;
    p.objs_per_layer = g.objs_per_layer;
    p.num_objs = g.num_objs();
    p.vec16 = vec16_;
    p.group = group_;
    p.queue0 = lane * workers_;
    p.window = window_;
    p.block_bytes = g.block_bytes;
    p.obj_bytes = g.obj_bytes;
    p.header_bytes = g.header_bytes;
    p.chunk_bytes = k_->chunk_bytes;
    p.staging = reinterpret_cast<uint8_t*>(dev_addr(k_->staging));
    p.queues = dev_queues_;
    p.iocbs = reinterpret_cast<Iocb*>(dev_addr(k_->iocbs));
    p.counters = counters_;
    p.abort = abort_;
    p.trace = trace_;
    p.mapped = dev_mapped_;
    p.crc = dev_crc_;
    p.crc_xor = crc_xor_;
    p.pieces = pieces_;
    std::memcpy(p.piece_shift, piece_shift_, sizeof(piece_shift_));
    for (uint32_t i = 0; i < p.n; ++i) {
      const Iocb& b = k_->iocbs[ids[first + i]];
      const RequestMem& m = req_[b.request];
      const LayerKV& l = k_->extents->layers()[b.layer];
      LaunchIocb& L = p.b[i];
      L.id = ids[first + i];
      L.op = b.op;
      L.layer = b.layer;
      L.ctx_first = b.ctx_first;
      L.ctx_count = b.ctx_count;
      L.issue_seq = b.issue_seq;
      L.ctx = m.ctx;
      L.extents = m.extents;
      L.expect = m.expect;
      L.failed = m.failed;
      L.failed_out = reinterpret_cast<uint8_t*>(dev_addr(m.failed_out));
      L.sums_out = reinterpret_cast<uint64_t*>(dev_addr(m.sums_out));
      L.pieces = m.pieces;
      L.kv[0] = l.ptr[0];
      L.kv[1] = l.ptr[1];
      L.block_stride = l.block_stride;
      L.copy_slot = m.copy_slot;
    }
    const int buf = copy_units_ ? stage_copies(p, ids + first, stream) : -1;
    const size_t smem = smem_bytes();
    io_kernel<<<grid, kThreads, smem, stream>>>(p);
    ++launches_;
    e = cudaGetLastError();
    if (e == cudaSuccess && buf >= 0) e = cudaEventRecord(read_ev_[buf], stream);  // the buffer is free again
    for (uint32_t i = 0; i < p.n && e == cudaSuccess; ++i) e = cudaEventRecord(events_[ids[first + i]], stream);
  }
  pop();
  if (e != cudaSuccess) return {Code::kDevice, cuda_msg("I/O kernel launch", e)};
  return Status::Ok();
}

// Stages the mapped objects of a launch's retrieves in the next copy buffer with one batched copy on
// the copy stream, and makes the launch's lane wait for it: the copy engine moves host memory to
// the GPU at the host-to-GPU limit, which the kernel's loads over PCIe do not reach (docs/CUDA.md,
// "The memory tier's path to the GPU"). The copy waits only for the buffer's last kernel, not for
// the caller's stream (it writes no KV block), so the next layer's copy runs while this layer's
// kernel verifies and scatters. Returns the buffer, or -1 when nothing was staged. Units past the
// buffer's room, and every unit when the copy cannot be queued (then never again), stay with the
// kernel's loads.
int CudaBackend::stage_copies(LaunchParams& p, const uint32_t* ids, cudaStream_t lane) {
  const Geometry& g = k_->geom;
  const uint64_t stride = static_cast<uint64_t>(g.objs_per_layer) * g.obj_bytes;
  const uint32_t buf = copy_next_;
  copy_dst_.clear();
  copy_src_.clear();
  uint32_t used = 0;  // units of the buffer taken by this launch
  for (uint32_t i = 0; i < p.n; ++i) {
    LaunchIocb& L = p.b[i];
    const CopyStage& c = req_[k_->iocbs[ids[i]].request].copy;
    if (L.op != static_cast<uint32_t>(IoOp::kRead) || c.units.empty()) continue;
    uint32_t lo = 0, hi = 0;
    c.slots_of(L.ctx_first, L.ctx_count, g.objs_per_layer, &lo, &hi);
    hi = std::min(hi, lo + (copy_units_ - used));
    L.copy_base = copy_buf_[buf] + static_cast<uint64_t>(used) * stride;
    L.copy_lo = lo;
    L.copy_hi = hi;
    for (uint32_t s = lo; s < hi; ++s, ++used) {
      copy_src_.push_back(reinterpret_cast<const void*>(c.src[s] + L.layer * stride));
      copy_dst_.push_back(copy_buf_[buf] + static_cast<uint64_t>(used) * stride);
    }
  }
  if (copy_dst_.empty()) return -1;
  copy_size_.assign(copy_dst_.size(), stride);
  cudaError_t e = cudaStreamWaitEvent(copy_stream_, read_ev_[buf], 0);  // its last kernel is done with it
  if (e == cudaSuccess) {
    e = cudaErrorNotSupported;
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
    e = cudaMemcpyBatchAsync(copy_dst_.data(), copy_src_.data(), copy_size_.data(), copy_dst_.size(), &attr, &attr_idx,
                             1, copy_stream_);
#else
    size_t fail = 0;
    e = cudaMemcpyBatchAsync(copy_dst_.data(), const_cast<void**>(copy_src_.data()), copy_size_.data(),
                             copy_dst_.size(), &attr, &attr_idx, 1, &fail, copy_stream_);
#endif
#endif
  }
  if (e == cudaSuccess) e = cudaEventRecord(copied_ev_[buf], copy_stream_);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(lane, copied_ev_[buf], 0);
  if (e == cudaSuccess) {
    copied_ += copy_dst_.size() * stride;
    copy_next_ = (buf + 1) % kCopyBufs;
    return static_cast<int>(buf);
  }
  // Nothing the kernel waits for was queued: it loads every mapped object itself, as with 0.
  cudaGetLastError();
  std::fprintf(stderr, "tutti: %s: the I/O kernel loads mapped objects itself from now on\n",
               cuda_msg("cannot stage mapped objects with the copy engine", e).c_str());
  copy_units_ = 0;
  for (uint32_t i = 0; i < p.n; ++i) p.b[i].copy_lo = p.b[i].copy_hi = 0;
  return -1;
}

Status CudaBackend::record_on(uint64_t stream, uint64_t* event) {
  if (!started_) return {Code::kDevice, "CUDA backend not started"};
  const cudaError_t e = cudaEventRecord(order_event_, reinterpret_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return {Code::kDevice, cuda_msg("cudaEventRecord on the caller's stream", e)};
  *event = reinterpret_cast<uint64_t>(order_event_);
  return Status::Ok();
}

bool CudaBackend::stream_wait(const uint32_t* ids, uint32_t n, uint64_t stream) {
  for (uint32_t i = 0; i < n; ++i)
    if (cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), events_[ids[i]], 0) != cudaSuccess) return false;
  return true;
}

Status CudaBackend::scatter_from_host(uint32_t slot, const uint8_t* unit, const uint64_t* dst, const uint64_t* sums,
                                      int64_t stream) {
  if (!started_) return {Code::kDevice, "CUDA backend not started"};
  const Geometry& g = k_->geom;
  const uint64_t nd = static_cast<uint64_t>(g.num_objs()) * g.unit_blocks;
  const uint64_t dev_bytes = scatter_dev_bytes(g);
  std::lock_guard<std::mutex> lk(scatter_mu_);
  ScatterSlot& sl = scatter_[slot];
  cudaSetDevice(device_);
  cudaError_t e = cudaSuccess;
  // The kernel reads the unit in place when it is in registered host memory, else from a copy.
  auto mapped_at = [](const uint8_t* q) {
    cudaPointerAttributes a{};
    const bool ok = cudaPointerGetAttributes(&a, q) == cudaSuccess && a.type == cudaMemoryTypeHost && a.devicePointer == q;
    cudaGetLastError();
    return ok;
  };
  // Both ends: a unit that runs past a registered region's end is copied, not read beyond it.
  const bool mapped = mapped_at(unit) && mapped_at(unit + g.slot_bytes - 1);
  const uint8_t* src = unit;
  if (!mapped) {
    if (!sl.bounce) {
      void* b = nullptr;
      Status st = alloc_host(g.slot_bytes, &b);
      if (!st.ok()) return st;
      sl.bounce = static_cast<uint8_t*>(b);
    }
    std::memcpy(sl.bounce, unit, g.slot_bytes);
    src = sl.bounce;
  }
  std::memcpy(sl.host, dst, nd * 8);
  std::memcpy(sl.host + nd * 8, sums, g.num_objs() * 8);
  std::memset(sl.host + dev_bytes, 0, g.num_objs());
  ScatterParams p{};
  p.unit = reinterpret_cast<const uint8_t*>(dev_addr(src));
  p.dst = reinterpret_cast<const uint64_t*>(sl.dev);
  p.expect = reinterpret_cast<const uint64_t*>(sl.dev + nd * 8);
  p.bad = reinterpret_cast<uint8_t*>(dev_addr(sl.host + dev_bytes));
  p.num_objs = g.num_objs();
  p.unit_blocks = g.unit_blocks;
  p.vec16 = vec16_ && reinterpret_cast<uintptr_t>(src) % 16 == 0 && g.header_bytes % 16 == 0 && g.obj_bytes % 16 == 0;
  p.crc_xor = crc_xor_;
  p.block_bytes = g.block_bytes;
  p.obj_bytes = g.obj_bytes;
  p.header_bytes = g.header_bytes;
  p.crc = dev_crc_;
  // Ordered like a retrieve's layer: after the work queued on the caller's stream so far (the
  // blocks' last users), and that stream's later work after the scatter (cross-context events, as
  // the I/O kernel's layers use them).
  cudaStream_t caller = reinterpret_cast<cudaStream_t>(stream);
  if (stream >= 0 && (e = cudaEventRecord(sl.order, caller)) != cudaSuccess)
    return {Code::kDevice, cuda_msg("cudaEventRecord on the caller's stream", e)};
  push();
  if (stream >= 0) e = cudaStreamWaitEvent(scatter_stream_, sl.order, 0);
  if (e == cudaSuccess) e = cudaMemcpyAsync(sl.dev, sl.host, dev_bytes, cudaMemcpyHostToDevice, scatter_stream_);
  if (e == cudaSuccess) {
    scatter_kernel<<<(p.num_objs + kScatterWarps - 1) / kScatterWarps, 32 * kScatterWarps, 0, scatter_stream_>>>(p);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaEventRecord(sl.done, scatter_stream_);
  pop();
  if (e == cudaSuccess && stream >= 0) e = cudaStreamWaitEvent(caller, sl.done, 0);
  if (e != cudaSuccess) {
    // What was queued may still run and read this slot's memory: let it finish before the slot is reused.
    push();
    cudaStreamSynchronize(scatter_stream_);
    pop();
    return {Code::kDevice, cuda_msg("scatter kernel", e)};
  }
  return Status::Ok();
}

Status CudaBackend::scatter_wait(uint32_t slot, int64_t* bad) {
  ScatterSlot& sl = scatter_[slot];
  *bad = -1;
  const cudaError_t e = cudaEventSynchronize(sl.done);
  if (e != cudaSuccess) return {Code::kDevice, cuda_msg("scatter kernel", e)};
  const Geometry& g = k_->geom;
  const uint8_t* flags = sl.host + (static_cast<uint64_t>(g.num_objs()) * g.unit_blocks + g.num_objs()) * 8;
  for (uint32_t o = 0; o < g.num_objs(); ++o)
    if (flags[o]) {  // the kernel's stores are visible: its completion event has been waited for
      *bad = o;
      break;
    }
  return Status::Ok();
}

Status CudaBackend::register_host(void* p, uint64_t n) {
  std::lock_guard<std::mutex> lk(scatter_mu_);
  if (std::find(host_regions_.begin(), host_regions_.end(), p) != host_regions_.end()) return Status::Ok();
  cudaSetDevice(device_);
  const cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return {Code::kDevice, cuda_msg("cudaHostRegister (remote staging arena)", e)};
  }
  host_regions_.push_back(p);
  return Status::Ok();
}

void CudaBackend::unregister_host(void* p) {
  std::lock_guard<std::mutex> lk(scatter_mu_);
  auto it = std::find(host_regions_.begin(), host_regions_.end(), p);
  if (it == host_regions_.end()) return;  // only what register_host registered
  cudaSetDevice(device_);
  // A scatter not yet waited for may still read the region in place (it runs when the caller's
  // stream gets there): let every queued one finish before the mapping goes.
  push();
  if (scatter_stream_) cudaStreamSynchronize(scatter_stream_);
  pop();
  cudaHostUnregister(p);
  host_regions_.erase(it);
}

void CudaBackend::stop() {
  if (!started_) return;
  started_ = false;
  cudaSetDevice(device_);
  __atomic_store_n(abort_, 1, __ATOMIC_RELEASE);
  push();
  for (cudaStream_t io : io_streams_)
    if (io) cudaStreamSynchronize(io);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  for (auto& ev : events_)
    if (ev) cudaEventDestroy(ev);
  events_.clear();
  for (uint32_t b = 0; b < kCopyBufs; ++b)
    for (cudaEvent_t* ev : {&copied_ev_[b], &read_ev_[b]}) {
      if (*ev) cudaEventDestroy(*ev);
      *ev = nullptr;
    }
  for (auto& m : req_) {
    if (m.uploaded) cudaEventDestroy(m.uploaded);
    if (m.dev) cudaFree(m.dev);
  }
  pop();
  if (order_event_) cudaEventDestroy(order_event_);
  order_event_ = nullptr;
  for (auto& m : req_) free_host(m.host, m.host_bytes);
  req_.clear();
  {
    std::lock_guard<std::mutex> lk(scatter_mu_);
    push();
    if (scatter_stream_) cudaStreamSynchronize(scatter_stream_);
    for (ScatterSlot& sl : scatter_)
      if (sl.done) cudaEventDestroy(sl.done);
    pop();
    for (ScatterSlot& sl : scatter_) {
      if (sl.dev) cudaFree(sl.dev);
      free_host(sl.host, sl.host_bytes);
      free_host(sl.bounce, k_->geom.slot_bytes);
      if (sl.order) cudaEventDestroy(sl.order);
      sl = ScatterSlot{};
    }
    for (void* r : host_regions_) cudaHostUnregister(r);
    host_regions_.clear();
  }
  if (trace_ && print_trace_) {
    unsigned long long t[4] = {0, 0, 0, 0};
    cudaMemcpy(t, trace_, sizeof(t), cudaMemcpyDeviceToHost);
    std::fprintf(stderr,
                 "tutti cuda trace: %llu launches x %u blocks, %u IOCTX(s) per I/O slot, block time %.3f s, manager idle %.3f s, worker busy %.3f s "
                 "over %llu objects (%.1f us each)\n",
                 static_cast<unsigned long long>(launches_), grid_, group_, t[2] * 1e-9, t[1] * 1e-9, t[0] * 1e-9, t[3],
                 t[3] ? t[0] * 1e-3 / t[3] : 0.0);
  }
  if (trace_) cudaFree(trace_);
  trace_ = nullptr;
  if (dev_queues_) cudaFree(dev_queues_);
  if (counters_) cudaFree(counters_);
  if (dev_mapped_) cudaFree(dev_mapped_);
  for (uint8_t*& b : copy_buf_) {
    if (b) cudaFree(b);
    b = nullptr;
  }
  copy_units_ = 0;
  if (dev_crc_) cudaFree(dev_crc_);
  dev_crc_ = nullptr;
  dev_mapped_ = nullptr;
  for (void* m : registered_) cudaHostUnregister(m);
  registered_.clear();
  dev_queues_ = nullptr;
  counters_ = nullptr;
  free_host(abort_, kAlign);
  abort_ = nullptr;
  destroy_streams();
  if (green_) {
    if (compute_green_) drv_.GreenCtxDestroy(compute_green_);
    if (io_green_) drv_.GreenCtxDestroy(io_green_);
  }
  io_green_ = compute_green_ = nullptr;
  io_ctx_ = nullptr;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device, bool pair_io, bool trace, uint64_t copy_bytes, Status* status) {
  auto b = std::make_unique<CudaBackend>(device, pair_io, trace, copy_bytes);
  *status = b->init();
  if (!status->ok()) return nullptr;
  return b;
}

}  // namespace tutti
