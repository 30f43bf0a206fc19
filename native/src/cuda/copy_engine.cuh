// The copy engine's stage (copy_engine_mb): a retrieve's objects in mapped pool files reach the GPU
// through the copy engine, which moves host memory at the host-to-GPU limit where the I/O kernel's
// loads over PCIe do not (docs/CUDA.md, "The memory tier's path to the GPU"), and the kernel then
// verifies and scatters them from device memory. Included only by cuda_backend.cu.
//
// Each launch that stages objects takes the next of two device buffers (by its sequence number)
// and hands a job to the copy thread: which slots of which request (copy_stage.h), at which place
// of the buffer. The driver takes about a microsecond per entry of a batched copy, so the engine's
// thread only queues the job and stream operations, O(1) in the units; the copy thread builds the
// entries and issues one cudaMemcpyBatchAsync per job on the copy stream. The order between the
// streams is kept by 64-bit words in device memory, written and waited for by stream memory
// operations (an event cannot be waited for before the thread records it):
//   copy stream, job s into buffer b: wait read[b] >= s - 2 (the buffer's last kernel is done),
//     the batch, ok[b] = s (only when the batch was queued), copied = s;
//   the launch's lane: wait copied >= s, the kernel, read[b] = s.
// The kernel takes the staged copy only where ok[b] equals its job's number, so a batch that could
// not be queued leaves the kernel's loads, and the stage then turns itself off. Every job queued is
// issued, its words written, even when its copy fails, so no lane waits forever.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "copy_stage.h"
#include "io_kernel.cuh"

namespace tutti {

namespace {

class CopyEngine {
 public:
  static constexpr uint32_t kBufs = 2;
  struct MemOps {  // the stream memory operations, from the driver's entry points
    PFN_cuStreamWaitValue64_v11070 wait = nullptr;
    PFN_cuStreamWriteValue64_v11070 write = nullptr;
  };

  ~CopyEngine() { stop(); }

  // Units per buffer; 0: the stage is off.
  uint32_t units() const { return units_; }
  uint64_t bytes_staged() const { return staged_.load(std::memory_order_relaxed); }

  // Sizes the buffers for `bytes` (whole unit-layers of `stride` bytes, split over the two buffers),
  // allocates them and the words, and starts the copy thread on `stream`, with `ctx` current on it
  // (null: the primary context of `device`). A stage too small for one unit-layer a buffer stays
  // off. An empty string when started or off; else why the memory could not be had.
  std::string start(uint64_t bytes, uint64_t stride, int device, cudaStream_t stream, MemOps ops, CUcontext ctx,
                    PFN_cuCtxPushCurrent_v4000 push) {
    stride_ = stride;
    units_ = stride ? static_cast<uint32_t>(std::min<uint64_t>(bytes / kBufs / stride, UINT32_MAX)) : 0;
    if (!units_) return {};
    if (!ops.wait || !ops.write) {
      std::fprintf(stderr, "tutti: the driver has no stream memory operations: copy_engine_mb is ignored\n");
      units_ = 0;
      return {};
    }
    cudaError_t e = cudaSuccess;
    for (uint32_t b = 0; b < kBufs && e == cudaSuccess; ++b) e = cudaMalloc(&buf_[b], uint64_t{units_} * stride);
    if (e == cudaSuccess) e = cudaMalloc(&words_, sizeof(uint64_t) * kWords);
    if (e == cudaSuccess) e = cudaMemset(words_, 0, sizeof(uint64_t) * kWords);
    if (e != cudaSuccess) {
      cudaGetLastError();
      release();
      return "copy_engine_mb (" + std::to_string(bytes >> 20) + " MiB) of device memory for the copy engine's stage: " +
             cudaGetErrorString(e) + "; a smaller copy_engine_mb, or 0, avoids it";
    }
    stream_ = stream;
    ops_ = ops;
    seq_ = 0;
    stopping_ = false;
    broken_ = false;
    thread_ = std::thread([this, device, ctx, push] {
      if (ctx) push(ctx);
      else cudaSetDevice(device);
      run();
    });
    return {};
  }

  // Issues every job queued (lanes wait for them), joins the thread and waits for the copy stream.
  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    thread_.join();
    cudaStreamSynchronize(stream_);
  }

  // After stop() and after every kernel that may read a buffer is done.
  void release() {
    for (uint8_t*& b : buf_) {
      if (b) cudaFree(b);
      b = nullptr;
    }
    if (words_) cudaFree(words_);
    words_ = nullptr;
    units_ = 0;
  }

  // Engine thread, one launch: gives its retrieves of mapped units their places in the next buffer
  // (as many units as it holds), queues their copy and makes `lane` wait for it. `stage_of(i)`: the
  // request plan of IOCB i, or null. Returns the job's number, or 0 when nothing is staged (then
  // the kernel loads everything itself). After the kernel, done(lane, job).
  template <typename StageOf>
  uint64_t stage(LaunchParams& p, cudaStream_t lane, StageOf stage_of) {
    if (!units_) return 0;
    if (broken_.load(std::memory_order_acquire)) {
      units_ = 0;
      return 0;
    }
    const uint64_t seq = seq_ + 1;
    const uint32_t b = static_cast<uint32_t>(seq % kBufs);
    Job job;
    job.seq = seq;
    job.buf = b;
    uint32_t used = 0;
    for (uint32_t i = 0; i < p.n && used < units_; ++i) {
      LaunchIocb& L = p.b[i];
      std::shared_ptr<const CopyStage> c = stage_of(i);
      if (L.op != static_cast<uint32_t>(IoOp::kRead) || !c || c->units.empty()) continue;
      uint32_t lo = 0, hi = 0;
      c->slots_of(L.ctx_first, L.ctx_count, p.objs_per_layer, &lo, &hi);
      hi = std::min(hi, lo + (units_ - used));
      if (hi == lo) continue;
      L.copy_base = buf_[b] + uint64_t{used} * stride_;
      L.copy_lo = lo;
      L.copy_hi = hi;
      job.part[job.n++] = {std::move(c), L.layer, lo, hi, used};
      used += hi - lo;
    }
    if (!used) return 0;
    if (ops_.wait(reinterpret_cast<CUstream>(lane), word(kCopied), seq, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
      for (uint32_t i = 0; i < p.n; ++i) p.b[i].copy_lo = p.b[i].copy_hi = 0;
      off("cannot order a lane after the copy stream");
      return 0;
    }
    p.copy_ok = words_ + kOk + b;
    p.copy_seq = seq;
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
    seq_ = seq;
    return seq;
  }

  // After job `seq`'s kernel on `lane`: its buffer may take the job after next.
  cudaError_t done(cudaStream_t lane, uint64_t seq) {
    if (ops_.write(reinterpret_cast<CUstream>(lane), word(kRead + seq % kBufs), seq, CU_STREAM_WRITE_VALUE_DEFAULT) ==
        CUDA_SUCCESS)
      return cudaSuccess;
    return cudaErrorUnknown;
  }

 private:
  static constexpr uint32_t kCopied = 0, kOk = 1, kRead = 1 + kBufs, kWords = 1 + 2 * kBufs;
  struct Part {
    std::shared_ptr<const CopyStage> stage;
    uint32_t layer, lo, hi, at;  // slots [lo, hi) of `stage` at layer `layer`, to buffer units at, at + 1, ...
  };
  struct Job {
    uint64_t seq = 0;
    uint32_t buf = 0, n = 0;
    Part part[kMaxLaunchIocbs];
  };

  CUdeviceptr word(uint32_t i) const { return reinterpret_cast<CUdeviceptr>(words_ + i); }

  void off(const char* why) {
    if (!broken_.exchange(true))
      std::fprintf(stderr, "tutti: %s: the I/O kernel loads mapped objects itself from now on\n", why);
  }

  void run() {
    std::vector<void*> dst;
    std::vector<const void*> src;
    std::vector<size_t> size;
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      dst.clear();
      src.clear();
      for (uint32_t i = 0; i < job.n; ++i) {
        const Part& q = job.part[i];
        for (uint32_t s = q.lo; s < q.hi; ++s) {
          src.push_back(reinterpret_cast<const void*>(q.stage->src[s] + q.layer * stride_));
          dst.push_back(buf_[job.buf] + uint64_t{q.at + s - q.lo} * stride_);
        }
      }
      size.assign(dst.size(), stride_);
      const CUstream s = reinterpret_cast<CUstream>(stream_);
      bool ok = !broken_.load(std::memory_order_relaxed);
      if (ok && job.seq > kBufs)
        ok = ops_.wait(s, word(kRead + job.buf), job.seq - kBufs, CU_STREAM_WAIT_VALUE_GEQ) == CUDA_SUCCESS;
      if (ok) {
        const cudaError_t e = batch(dst, src, size);
        ok = e == cudaSuccess;
        if (!ok) {
          cudaGetLastError();
          off((std::string("cannot stage mapped objects with the copy engine: ") + cudaGetErrorString(e)).c_str());
        }
      }
      if (ok && ops_.write(s, word(kOk + job.buf), job.seq, CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS)
        staged_.fetch_add(dst.size() * stride_, std::memory_order_relaxed);
      if (ops_.write(s, word(kCopied), job.seq, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS)
        off("cannot release a lane from the copy stream");
    }
  }

  cudaError_t batch(std::vector<void*>& dst, std::vector<const void*>& src, std::vector<size_t>& size) {
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
    return cudaMemcpyBatchAsync(dst.data(), src.data(), size.data(), dst.size(), &attr, &attr_idx, 1, stream_);
#else
    size_t fail = 0;
    return cudaMemcpyBatchAsync(dst.data(), const_cast<void**>(src.data()), size.data(), dst.size(), &attr, &attr_idx,
                                1, &fail, stream_);
#endif
#else
    (void)dst;
    (void)src;
    (void)size;
    return cudaErrorNotSupported;
#endif
  }

  uint64_t stride_ = 0;
  uint32_t units_ = 0;  // engine thread
  uint8_t* buf_[kBufs] = {};
  uint64_t* words_ = nullptr;  // device: [kCopied], [kOk + b], [kRead + b]
  cudaStream_t stream_ = nullptr;
  MemOps ops_;
  uint64_t seq_ = 0;  // engine thread: the last job's number
  std::atomic<uint64_t> staged_{0};
  std::atomic<bool> broken_{false};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
};

}  // namespace

}  // namespace tutti
