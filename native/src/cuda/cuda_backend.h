// The CUDA backend's host side (a private header of its translation units): the I/O kernel on a
// green-context SM partition, rings and staging in mapped pinned host memory, stream-ordered issue
// and completion. One file per part of its life: cuda_backend.cu sets the device up and tears it
// down, cuda_launch.cu moves requests (the per-request arrays, the launches, the copy engine's
// stage: copy_stage.h), cuda_scatter.cu is the remote path. The kernels are in io_kernel.cu.
//
// Commit headers are not the kernel's: the store writes a unit's header once every layer of it is
// on storage (UnitStore::commit_units).
//
// The driver API (green contexts exist only there on CUDA 13.0) is resolved at run time through
// cudaGetDriverEntryPointByVersion: the module links no libcuda and imports on hosts without a GPU.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"
#include "copy_stage.h"
#include "io_kernel.h"
#include "tutti/crc32c.h"

namespace tutti {
namespace gpu {

inline std::string cuda_msg(const char* what, cudaError_t e) { return std::string(what) + ": " + cudaGetErrorString(e); }

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

  // Resolves every entry point; false when one is missing (their names in `missing`).
  bool load(std::string* missing);
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

// A scatter slot's device arrays: each object's destination block addresses, then each object's
// expected checksum; the slot's mapped host copy has one verdict byte per object after them.
inline uint64_t scatter_dev_bytes(const Geometry& g) {
  return (static_cast<uint64_t>(g.num_objs()) * g.unit_blocks + g.num_objs()) * 8;
}

}  // namespace gpu
}  // namespace tutti
