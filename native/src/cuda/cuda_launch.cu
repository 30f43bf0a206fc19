// The CUDA backend (cuda_backend.h): a request's arrays on the device, and its layers' launches
// with the copy engine's stage before them.
#include <atomic>
#include <cstdio>
#include <cstring>

#include "cuda_backend.h"

namespace tutti {
namespace gpu {

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

}  // namespace gpu
}  // namespace tutti
