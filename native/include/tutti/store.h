// The engine session: a unit store (unit_store.h) with the extent map over the engine's KV memory,
// the IOCB table, gio_uring queues, agent and backend, behind the engine API.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tutti/common.h"
#include "tutti/gio_uring.h"
#include "tutti/layout.h"
#include "tutti/options.h"
#include "tutti/unit_store.h"

namespace tutti {

// The machinery behind the engine API is the core's own (native/src: extent.h, gio_queue.h,
// agent.h, backend.h).
class Agent;
class Backend;
class Doorbell;
class ExtentMap;
struct Extent;
struct Iocb;
struct Ioctx;
struct KernelContext;
struct RequestView;

// Why a unit of a request failed (RequestResult::failures); unit_fail_cause_name gives its short name.
enum class UnitFailCause : uint8_t {
  kChecksum = 1,      // retrieve: an object's bytes are not those written (the unit is dropped)
  kIoError,           // a read or write of the pool file failed or came up short (UnitFailure::error)
  kNotPresent,        // retrieve: not in the pool (evicted or removed since the lookup)
  kTooFewBlocks,      // retrieve: a partial unit holds fewer blocks than asked for
  kNoFreeSlot,        // store: every slot holds a unit being read, written or pinned
  kIncompleteLayers,  // a layer was never issued or its I/O could not start (every unit failed)
  kDeviceError,       // the device failed: the kernel could not vouch for the unit
  kCommitFailed,      // store: the unit's header could not be written
};
const char* unit_fail_cause_name(UnitFailCause c);

// One failed unit of a request: why, and where it lay (a unit without a slot: pool_file empty).
struct UnitFailure {
  uint32_t unit = 0;  // index in the request
  uint64_t key = 0;
  UnitFailCause cause = UnitFailCause::kIoError;
  int32_t error = 0;       // kIoError: the errno, when the backend knows it (0: a short transfer, or unknown)
  std::string pool_file;   // the pool file that holds the unit's slot, empty when it had none
  uint32_t slot = kNoSlot;  // the slot's index within pool_file
  uint64_t offset = 0;      // the slot's byte offset in pool_file
};

struct RequestResult {
  uint32_t units = 0;
  std::vector<uint32_t> failed_units;
  std::vector<UnitFailure> failures;  // one per failed unit, in failed_units' order
  uint32_t skipped_units = 0;  // store: already present
  std::vector<uint32_t> committed_units;  // store: made visible by this request
  // Layers never issued, or whose I/O could not be started: when any, every unit of the request
  // failed (retrieve: nothing counts as loaded; store: nothing is committed).
  std::vector<uint32_t> incomplete_layers;
};

enum class ReqOp : uint32_t { kRetrieve = 1, kStore = 2 };

class Store : public UnitStore {
 public:
  // Opens the pool (creating it when needed) and rebuilds the index from the slot headers.
  static Status open(const StoreOptions& opt, const std::vector<LayerKV>& layers, const std::string& desc,
                     std::unique_ptr<Store>* out);
  ~Store() override;

  // Sets up the IOCB table (`depth` IOCBs), staging, SQ/CQ pairs, the agent and the I/O kernel.
  Status init_queue(uint32_t depth);
  bool started() const { return started_; }

  // Engine API. begin_* takes the request's keys and block ids once (O(blocks)) and reserves every
  // IOCB the request will use (CapacityExceeded, with nothing held, when the table cannot hold them),
  // so a layer call never runs out; the per-layer calls are O(1) on the host: each posts the layer's
  // prepared IOCBs.
  // A store may name each unit's inner block keys (layout.h, format 4): `n_inner[u]` of them for unit
  // u, one after another in `inner`; both null for none.
  Status begin(ReqOp op, const uint64_t* keys, uint32_t n_units, const int64_t* block_ids, uint64_t n_blocks,
               uint32_t* request, const uint64_t* inner = nullptr, const uint32_t* n_inner = nullptr);
  // Posts one layer, ordered after `event` (a device event handle) when given, else after the work
  // queued on `stream` (a device stream handle; 0 is the legacy default stream) when >= 0.
  Status layer(uint32_t layer, uint32_t request, uint64_t event, int64_t stream = -1);
  // Waits for a layer: on the host, or, with a device `stream`, by making that stream wait.
  Status wait_layer(uint32_t layer, uint32_t request, uint64_t stream = 0);
  Status finish(uint32_t request, RequestResult* out);
  // Whether every IOCB the request has issued (layer calls and gio_uring IOCBs) is done, without
  // waiting: `finish` then returns at once.
  Status done(uint32_t request, bool* out);

  // gio_uring API. IOCBs taken with get_iocb belong to the caller until put_iocb; fill_iocb points
  // one at IOCTXs [first, first + count) of an active request. Every id, request, range and layer
  // is checked; an IOCB in flight can be neither refilled, reissued nor put back.
  Status get_iocb(uint32_t n, std::vector<uint32_t>* ids);
  Status fill_iocb(uint32_t id, IoOp op, uint32_t layer, uint32_t request, uint32_t first, uint32_t count);
  Status issue_io(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event);
  Status wait_cqe(uint32_t iocb, uint64_t* errors = nullptr);
  Status put_iocb(uint32_t iocb);
  // Stream on the SMs outside the I/O partition (CUDA backend), 0 otherwise.
  uint64_t compute_stream() const;

  // Places a GPU file held in host memory (a unit another node sent) into one unit's KV blocks,
  // verifying it on the same pass (Backend::scatter_from_host); returns once the blocks hold it.
  // NotFound when the unit fails its checksums (the blocks then hold no valid KV).
  Status scatter_unit(const uint8_t* data, uint64_t n, const int64_t* block_ids, uint64_t n_blocks);
  // The same, ordered on `stream` (a cudaStream_t handle, 0 the default stream; see
  // Backend::scatter_from_host), returning before the scatter may have run: *ticket names it for
  // scatter_wait, which gives the verdict. At most kScatterSlots at once, synchronous scatters
  // included (CapacityExceeded beyond); `data` must stay valid until scatter_wait returns. With
  // `want_key`, a unit whose header names another key is a miss (NotFound), as a corrupt one is.
  Status scatter_unit_async(const uint8_t* data, uint64_t n, const int64_t* block_ids, uint64_t n_blocks,
                            int64_t stream, uint64_t* ticket, const uint64_t* want_key = nullptr);
  // Waits for the scatter of `ticket`: Ok when the blocks hold the unit, NotFound when it failed its
  // checksums, DeviceError when the device failed. Each ticket is waited for once.
  Status scatter_wait(uint64_t ticket);
  // Host memory that scatter_unit may read in place from then on (see Backend::register_host).
  Status register_host(void* p, uint64_t n);
  void unregister_host(void* p);

  StoreStats stats() const override;
  void close() override;

 private:
  struct Request {
    bool active = false;
    bool finishing = false;  // finish has begun: nothing more may be issued against it
    ReqOp op{};
    std::vector<uint64_t> keys;
    std::vector<uint32_t> unit_slot;
    std::vector<uint8_t> unit_present;  // retrieve: pinned; store: slot reserved
    std::vector<uint8_t> unit_failed;
    std::vector<int32_t> unit_errno;   // written by a host kernel with an I/O error (RequestView)
    std::vector<uint8_t> unit_cause;   // UnitFailCause found on the host (begin, finish), 0 when none
    std::vector<uint32_t> unit_blocks;  // KV blocks each unit moves: unit_blocks, fewer for a partial last unit
    std::vector<std::vector<uint64_t>> inner;  // store: each unit's inner block keys (may be empty)
    std::vector<Ioctx> ctx;
    std::vector<Extent> extents;
    std::vector<uint64_t> checksums;
    std::vector<std::vector<uint32_t>> layer_iocbs;  // reserved at begin
    std::vector<uint32_t> raw_iocbs;                 // gio_uring API IOCBs filled against it
    // Per layer: IOCTX ranges [first, first + count) that gio_uring IOCBs moved without errors.
    std::vector<std::vector<std::pair<uint32_t, uint32_t>>> raw_done;
    std::vector<uint8_t> layer_issued;
    std::vector<uint8_t> layer_failed;               // its I/O could not be started
    uint32_t skipped = 0;
  };
  static constexpr uint32_t kRawOwner = UINT32_MAX;  // iocb_owner_: taken with get_iocb
  // A gio_uring IOCB's last issue, until settled into its request's raw_done.
  struct RawIssue {
    uint32_t request = UINT32_MAX, layer = 0, first = 0, count = 0;
    uint64_t seq = 0;
  };
  // A request that may still be used: begun, and finish not begun. Under mu_.
  bool open_request(uint32_t id) const { return id < requests_.size() && requests_[id].active && !requests_[id].finishing; }
  // The IOCBs a request has issued: its layers' and the gio_uring IOCBs filled against it. Under mu_.
  std::vector<uint32_t> issued_iocbs(const Request& r) const;
  void settle_raw(uint32_t id);                                                 // under mu_
  bool layer_complete(const Request& r, uint32_t layer) const;                  // under mu_
  Store();
  Status take_iocbs(uint32_t n, uint32_t owner, std::vector<uint32_t>* ids);  // under mu_
  void give_back_iocb(uint32_t id);                                             // under mu_
  Status issue_locked(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event);
  bool in_flight(uint32_t id) const;
  void wait_done(uint32_t id);
  void release_request(uint32_t id, Request& r);
  // Takes a free scatter slot for a new ticket (under scatter_mu_).
  Status take_scatter_slot(uint32_t* slot, uint64_t* ticket);
  void free_scatter_slot(uint32_t slot);

  std::unique_ptr<ExtentMap> extents_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<Doorbell> kernel_bell_, done_bell_;
  std::unique_ptr<KernelContext> kctx_;
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
  std::vector<RawIssue> raw_issue_;    // per IOCB
  static constexpr uint32_t kFree = UINT32_MAX - 1;
  std::vector<Request> requests_;
  std::vector<RequestView> views_;
  uint64_t request_map_peak_ = 0;
  // Scatters in flight (scatter_unit_async): each slot's ticket, 0 when free; waited_: being waited for.
  std::mutex scatter_mu_;
  uint64_t scatter_ticket_[kScatterSlots] = {};
  bool scatter_waited_[kScatterSlots] = {};
  uint64_t next_ticket_ = 1;
  bool started_ = false;
};

}  // namespace tutti
