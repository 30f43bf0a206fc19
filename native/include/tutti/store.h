// The store: file pool, index, extent map, gio_uring queues and agent, behind the engine API.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tutti/backend.h"
#include "tutti/common.h"
#include "tutti/gio_uring.h"
#include "tutti/index.h"
#include "tutti/layout.h"
#include "tutti/pool.h"

namespace tutti {

// Defaults are TuttiConfig's (tutti_cluster/config.py; a test keeps them equal); the Python side
// sets every field from the configuration anyway.
struct StoreOptions {
  std::vector<std::string> paths;
  std::vector<uint64_t> capacity;  // bytes per path
  std::string instance = "default";
  uint32_t files_per_path = 0;     // pool files per path; 0: up to 16 on memory file systems, 1 elsewhere
  bool prewrite = true;            // zero what fallocate left unwritten, once (see FilePool::open)
  uint32_t unit_blocks = 16;
  uint32_t queue_depth = 64;       // io_uring depth of the agent
  uint64_t staging_bytes = 128ull << 20;
  uint32_t max_requests = 256;     // requests in flight
  uint32_t io_workers = 1;         // kernel workers (thread blocks / host scatter threads)
  uint32_t io_sms = 8;
  uint64_t min_io_bytes = 256 << 10;
  DirectMode direct = DirectMode::kAuto;
  std::string backend = "cpu";     // "cpu" or "cuda"
  int device = 0;
  bool cuda_pair = false;          // CUDA: K and V of a unit-layer as one I/O (slower on the H200 host)
  bool cuda_trace = false;         // CUDA: print the I/O kernel's counters when the store closes
  bool read_only = false;          // open existing pools for reading only (no agent)
  // Map the pool files on memory file systems and move their objects with loads and stores
  // instead of io_uring (byte-addressable storage); files elsewhere still go through the agent.
  bool map_memory = true;
};

struct RequestResult {
  uint32_t units = 0;
  std::vector<uint32_t> failed_units;
  uint32_t skipped_units = 0;  // store: already present
  std::vector<uint32_t> committed_units;  // store: made visible by this request
  // Layers never issued, or whose I/O could not be started: when any, every unit of the request
  // failed (retrieve: nothing counts as loaded; store: nothing is committed).
  std::vector<uint32_t> incomplete_layers;
};

struct StoreStats {
  uint64_t units = 0, pinned = 0, free_slots = 0, total_slots = 0;
  uint64_t hits = 0, lookups = 0, evictions = 0, checksum_failures = 0, io_errors = 0;
  uint64_t bad_headers = 0;  // slots whose header did not verify when the index was (re)built
  uint64_t bytes_read = 0, bytes_written = 0, agent_ops = 0;
  double agent_cpu_s = 0, kernel_cpu_s = 0;
  // Extent map: per-layer descriptors plus the largest request's extents and IOCTXs so far.
  uint64_t extent_map_bytes = 0, request_map_peak_bytes = 0, staging_bytes = 0, slot_bytes = 0, obj_bytes = 0;
  bool direct_io = false, fixed_buffers = false;
  uint32_t mapped_files = 0;  // pool files the I/O kernel moves with loads and stores (map_memory)
  std::string backend;
};

enum class ReqOp : uint32_t { kRetrieve = 1, kStore = 2 };

class Store {
 public:
  // Opens the pool (creating it when needed) and rebuilds the index from the slot headers.
  static Status open(const StoreOptions& opt, const std::vector<LayerKV>& layers, const std::string& desc,
                     std::unique_ptr<Store>* out);
  ~Store();

  const Geometry& geometry() const { return geom_; }
  // Sets up the IOCB table (`depth` IOCBs), staging, SQ/CQ pairs, the agent and the I/O kernel.
  Status init_queue(uint32_t depth);
  bool started() const { return started_; }
  uint32_t lookup(const uint64_t* keys, uint32_t n);

  // Engine API. begin_* takes the request's keys and block ids once (O(blocks)) and reserves every
  // IOCB the request will use (CapacityExceeded, with nothing held, when the table cannot hold them),
  // so a layer call never runs out; the per-layer calls are O(1) on the host: each posts the layer's
  // prepared IOCBs.
  Status begin(ReqOp op, const uint64_t* keys, uint32_t n_units, const int64_t* block_ids, uint64_t n_blocks,
               uint32_t* request);
  // Posts one layer, ordered after `event` (a device event handle) when given, else after the work
  // queued on `stream` (a device stream handle; 0 is the legacy default stream) when >= 0.
  Status layer(uint32_t layer, uint32_t request, uint64_t event, int64_t stream = -1);
  // Waits for a layer: on the host, or, with a device `stream`, by making that stream wait.
  Status wait_layer(uint32_t layer, uint32_t request, uint64_t stream = 0);
  Status finish(uint32_t request, RequestResult* out);

  // gio_uring API. IOCBs taken with get_iocb belong to the caller until put_iocb; fill_iocb points
  // one at IOCTXs [first, first + count) of an active request. Every id, request, range and layer
  // is checked; an IOCB in flight can be neither refilled, reissued nor put back.
  Status get_iocb(uint32_t n, std::vector<uint32_t>* ids);
  Status fill_iocb(uint32_t id, IoOp op, uint32_t layer, uint32_t request, uint32_t first, uint32_t count);
  Status issue_io(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event);
  Status wait_cqe(uint32_t iocb, uint64_t* errors = nullptr);
  Status put_iocb(uint32_t iocb);
  // Stream on the SMs outside the I/O partition (CUDA backend), 0 otherwise.
  uint64_t compute_stream() const { return backend_ ? backend_->compute_stream() : 0; }

  // CPU paths for other nodes and replicas.
  Status read_unit(uint64_t key, std::vector<uint8_t>* out);
  // Reads and verifies a whole GPU file into `dst` (`cap` bytes, at least slot_bytes); in place, with
  // O_DIRECT, when `dst` is 4 KiB aligned.
  Status read_unit_into(uint64_t key, uint8_t* dst, uint64_t cap, bool verify = true);
  // Read-only stores: rescans the headers to see units committed since open.
  Status refresh();
  Status import_unit(const uint8_t* data, uint64_t n, uint64_t* key);
  Status scatter_unit(const uint8_t* data, uint64_t n, const int64_t* block_ids, uint64_t n_blocks);
  // Host memory that scatter_unit may read in place from then on (see Backend::register_host).
  Status register_host(void* p, uint64_t n);
  void unregister_host(void* p);

  void pin(const uint64_t* keys, uint32_t n, bool on);
  bool remove(uint64_t key);
  std::vector<uint64_t> keys() const { return index_.keys(); }
  StoreStats stats() const;
  // Evicted keys since the last call (for the node daemon and cluster directory).
  std::vector<uint64_t> drain_evicted();
  void close();

 private:
  struct Request {
    bool active = false;
    ReqOp op{};
    std::vector<uint64_t> keys;
    std::vector<uint32_t> unit_slot;
    std::vector<uint8_t> unit_present;  // retrieve: pinned; store: slot reserved
    std::vector<uint8_t> unit_failed;
    std::vector<Ioctx> ctx;
    std::vector<Extent> extents;
    std::vector<uint64_t> checksums;
    std::vector<std::vector<uint32_t>> layer_iocbs;  // reserved at begin
    std::vector<uint32_t> commit_iocbs;              // store: reserved at begin
    std::vector<uint32_t> raw_iocbs;                 // gio_uring API IOCBs filled against it
    std::vector<uint8_t> layer_issued;
    std::vector<uint8_t> layer_failed;               // its I/O could not be started
    uint32_t skipped = 0;
  };
  static constexpr uint32_t kRawOwner = UINT32_MAX;  // iocb_owner_: taken with get_iocb
  Store() = default;
  Status recover();
  Status alloc_slot(uint32_t* slot);
  void free_slot(uint32_t slot);
  // A GPU file's size and header (key, layout, per-object checksums into *sums); verify_unit also
  // checks every object against its checksum.
  Status decode_unit(const uint8_t* data, uint64_t n, uint64_t* key, std::vector<uint64_t>* sums) const;
  Status verify_unit(const uint8_t* data, uint64_t n, uint64_t* key, std::vector<uint64_t>* sums) const;
  Status take_iocbs(uint32_t n, uint32_t owner, std::vector<uint32_t>* ids);  // under mu_
  void give_back_iocb(uint32_t id);                                             // under mu_
  Status issue_locked(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event);
  bool in_flight(uint32_t id) const;
  void wait_done(uint32_t id);
  void release_request(uint32_t id, Request& r);

  StoreOptions opt_;
  Geometry geom_;
  std::string desc_;
  FilePool pool_;
  Index index_;
  ExtentMap extents_;
  std::unique_ptr<Backend> backend_;
  Agent agent_;
  Doorbell kernel_bell_, done_bell_;
  KernelContext kctx_;
  void* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
  void* queue_mem_ = nullptr;
  uint64_t queue_bytes_ = 0;
  // The IOCB table lives in backend host memory, so that a device kernel can write done_seq.
  Iocb* iocbs_ = nullptr;
  uint32_t num_iocbs_ = 0;
  uint64_t iocb_bytes_ = 0;
  std::vector<uint32_t> free_iocbs_;
  std::vector<uint32_t> iocb_owner_;  // request id, kRawOwner, or kFree
  static constexpr uint32_t kFree = UINT32_MAX - 1;
  std::vector<Request> requests_;
  std::vector<RequestView> views_;
  std::vector<uint64_t> slot_checksums_;
  std::vector<uint64_t> slot_key_;
  uint64_t commit_seq_ = 1;
  mutable std::mutex mu_;
  std::vector<uint64_t> evicted_;
  uint64_t lookups_ = 0, hits_ = 0, evictions_ = 0, checksum_failures_ = 0, io_errors_ = 0, bad_headers_ = 0;
  uint64_t bytes_read_ = 0, bytes_written_ = 0, request_map_peak_ = 0;
  bool started_ = false;
};

}  // namespace tutti
