// The CUDA backend (cuda_backend.h): the remote path, one unit from host memory scattered into
// its KV blocks and verified, and the host regions it may read in place.
#include <cstring>

#include "cuda_backend.h"

namespace tutti {
namespace gpu {

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

}  // namespace gpu
}  // namespace tutti
