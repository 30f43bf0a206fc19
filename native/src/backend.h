// The device seam: staging memory and the I/O kernel. A host backend is always built; the CUDA
// backend (native/src/cuda) implements the same interface. Everything else (layout, index, rings,
// agent) is shared.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "agent.h"
#include "extent.h"
#include "gio_queue.h"
#include "tutti/common.h"
#include "tutti/layout.h"
#include "tutti/options.h"

namespace tutti {

// Per-request state that the I/O kernel reads and writes.
struct RequestView {
  const Ioctx* ctx = nullptr;
  const Extent* extents = nullptr;
  uint64_t* checksums = nullptr;            // [unit][obj]: expected on retrieve, written by the kernel on store
  uint8_t* unit_failed = nullptr;           // written by the kernel: 1 an I/O error, 2 a checksum mismatch
  int32_t* unit_errno = nullptr;            // written by a host kernel with an I/O error: its errno (0: short)
  uint32_t num_units = 0;
};

// Everything an I/O kernel needs, set up once by the store.
struct KernelContext {
  Geometry geom;
  ExtentMap* extents = nullptr;
  Iocb* iocbs = nullptr;
  uint32_t num_iocbs = 0;
  RequestView* requests = nullptr;               // indexed by request id
  uint32_t max_requests = 0;
  uint8_t* staging = nullptr;                    // host address of the staging region
  uint64_t chunk_bytes = 0;
  uint32_t num_chunks = 0;
  std::vector<QueuePair> queues;                 // one per kernel worker
  uint32_t queue_depth = 0;                      // I/Os the agent keeps in flight at most
  // Per pool file: the alignment every buffer address and length of its I/O needs (1: any buffer,
  // a memory file system or no O_DIRECT). A host kernel moves objects straight between the file and
  // KV blocks that meet it with scatter-gather I/O.
  std::vector<uint32_t> buffer_align;
  // Per pool file: its shared mapping (map_memory), or null. The I/O kernel moves the objects of a
  // mapped file with loads and stores, without SQEs or staging; headers still go through the agent.
  std::vector<uint8_t*> mapped;
  std::vector<uint64_t> mapped_bytes;
  Agent* agent = nullptr;
  Doorbell* kernel_bell = nullptr;               // agent -> kernel (host backend)
  Doorbell* done_bell = nullptr;                 // kernel -> engine, on every finished IOCB
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // True when the kernel (a GPU) can neither write an eventfd nor ring a doorbell: the agent then
  // polls the SQs, and host waits poll the IOCBs' done_seq.
  virtual bool host_agent_polls() const = 0;
  // Page-aligned, populated host memory usable by io_uring and by the kernel.
  virtual Status alloc_host(uint64_t bytes, void** ptr) = 0;
  virtual void free_host(void* ptr, uint64_t bytes) = 0;
  virtual Status start(KernelContext* ctx, uint32_t workers) = 0;
  // Places one unit held in host memory (a GPU file, header first: a unit another node sent) into
  // the KV blocks and verifies each object's CRC32C in the same pass, as scatter `slot` (one of
  // kScatterSlots; the caller owns it until scatter_wait). `dst`: the block addresses, num_objs x
  // unit_blocks, object-major; `sums`: the objects' CRC32C from the unit's verified header (both
  // copied before it returns). `stream` >= 0 (a cudaStream_t handle on CUDA, 0 its default stream):
  // ordered on that stream, like a retrieve's layer: the scatter starts after the work queued there
  // so far, and the work queued there afterwards waits for it; the call may return before the
  // scatter ran, and `unit` must stay valid until scatter_wait. `stream` < 0: ordered on no stream.
  // A failure of the device is the Status, never a bad object.
  virtual Status scatter_from_host(uint32_t slot, const uint8_t* unit, const uint64_t* dst, const uint64_t* sums,
                                   int64_t stream) = 0;
  // Waits for scatter `slot`: *bad = the first object that failed its checksum, or -1. When it
  // returns the blocks are written, for the host and for whatever any stream queues afterwards.
  virtual Status scatter_wait(uint32_t slot, int64_t* bad) = 0;
  // Host memory that scatter_from_host may then read in place (a GPU maps it: the remote path's
  // staging arena). Without it a GPU backend first copies each unit into pinned memory of its own.
  virtual Status register_host(void* p, uint64_t n) {
    (void)p;
    (void)n;
    return Status::Ok();
  }
  virtual void unregister_host(void* p) { (void)p; }
  // Enqueues the I/O kernel for these IOCBs (issue_io). `event` orders it after the caller's stream
  // on devices that have streams; 0 means "now".
  virtual Status launch(const uint32_t* iocb_ids, uint32_t n, uint32_t sms, uint64_t event) = 0;
  virtual void stop() = 0;
  virtual double kernel_cpu_seconds() const = 0;
  // I/Os that moved their objects straight between a pool file and the KV blocks (no staging).
  virtual uint64_t direct_ios() const { return 0; }
  // Bytes of mapped objects the copy engine staged in device memory for retrieves (copy_engine_mb).
  virtual uint64_t copy_engine_bytes() const { return 0; }
  // Kernel workers (SQ/CQ pairs served by the I/O kernel) for `io_workers` requested and `sms`
  // SMs: the host backend has one kernel thread (and helpers), a GPU one thread block per SM of its
  // partition.
  virtual uint32_t num_workers(uint32_t io_workers, uint32_t sms) const {
    (void)sms;
    return io_workers;
  }
  // SQ/CQ pairs the store allocates: one per worker by default.
  virtual uint32_t num_queues(uint32_t workers) const { return workers; }
  // A stream on the SMs left to compute (the complement of the I/O partition), 0 when none.
  virtual uint64_t compute_stream() const { return 0; }
  // Called by the engine thread when a request starts and before its result is read: a device
  // backend mirrors the request's arrays to the device and copies the kernel's outputs back.
  virtual Status begin_request(uint32_t id, RequestView* view) {
    (void)id;
    (void)view;
    return Status::Ok();
  }
  virtual Status end_request(uint32_t id, RequestView* view) {
    (void)id;
    (void)view;
    return Status::Ok();
  }
  // Records an event on the caller's `stream` (a device stream handle) for the next launch to wait
  // on, so that it starts after the work queued there; *event = 0 on backends without streams.
  virtual Status record_on(uint64_t stream, uint64_t* event) {
    (void)stream;
    *event = 0;
    return Status::Ok();
  }
  // Makes `stream` wait for these IOCBs without blocking the host. Returns false when the backend
  // has no streams, and the caller then waits on the host (wait_cqe).
  virtual bool stream_wait(const uint32_t* ids, uint32_t n, uint64_t stream) {
    (void)ids;
    (void)n;
    (void)stream;
    return false;
  }
};

std::unique_ptr<Backend> make_host_backend();
#ifdef TUTTI_WITH_CUDA
// `pair_io`: K and V of a unit-layer as one I/O; `trace`: print the kernel's counters at stop.
// `copy_bytes`: device memory for the copy engine's stage of mapped objects (copy_stage.h), 0: none.
std::unique_ptr<Backend> make_cuda_backend(int device, bool pair_io, bool trace, uint64_t copy_bytes, Status* status);
#endif

}  // namespace tutti
