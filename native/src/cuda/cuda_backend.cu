// The CUDA backend (cuda_backend.h): the device, its partition and everything start() makes and
// stop() releases.
#include <cstdio>
#include <memory>

#include "cuda_backend.h"

namespace tutti {
namespace gpu {

namespace {

template <typename F>
bool entry_point(const char* name, unsigned version, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || p == nullptr)
    return false;
  *fn = reinterpret_cast<F>(p);
  return true;
}

}  // namespace

bool Driver::load(std::string* missing) {
  bool ok = true;
  auto need = [&](bool got, const char* name) {
    if (!got) {
      ok = false;
      *missing += std::string(missing->empty() ? "" : ", ") + name;
    }
  };
  need(entry_point("cuDeviceGet", 2000, &DeviceGet), "cuDeviceGet");
  need(entry_point("cuDeviceGetDevResource", 12040, &DeviceGetDevResource), "cuDeviceGetDevResource");
  need(entry_point("cuDevSmResourceSplitByCount", 12040, &DevSmResourceSplitByCount), "cuDevSmResourceSplitByCount");
  need(entry_point("cuDevResourceGenerateDesc", 12040, &DevResourceGenerateDesc), "cuDevResourceGenerateDesc");
  need(entry_point("cuGreenCtxCreate", 12040, &GreenCtxCreate), "cuGreenCtxCreate");
  need(entry_point("cuGreenCtxDestroy", 12040, &GreenCtxDestroy), "cuGreenCtxDestroy");
  need(entry_point("cuCtxFromGreenCtx", 12040, &CtxFromGreenCtx), "cuCtxFromGreenCtx");
  need(entry_point("cuGreenCtxStreamCreate", 12050, &GreenCtxStreamCreate), "cuGreenCtxStreamCreate");
  need(entry_point("cuCtxPushCurrent", 4000, &CtxPushCurrent), "cuCtxPushCurrent");
  need(entry_point("cuCtxPopCurrent", 4000, &CtxPopCurrent), "cuCtxPopCurrent");
  need(entry_point("cuStreamDestroy", 4000, &StreamDestroy), "cuStreamDestroy");
  return ok;
}

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

}  // namespace gpu

std::unique_ptr<Backend> make_cuda_backend(int device, bool pair_io, bool trace, uint64_t copy_bytes, Status* status) {
  auto b = std::make_unique<gpu::CudaBackend>(device, pair_io, trace, copy_bytes);
  *status = b->init();
  if (!status->ok()) return nullptr;
  return b;
}

}  // namespace tutti
