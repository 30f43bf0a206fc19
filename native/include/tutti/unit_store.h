// The unit store: a share of the node's file pool, its index and the header codec: reading,
// importing and verifying GPU files, pins and eviction. It needs only the geometry, not the KV
// memory, so the node daemon and the cluster serve from it. An engine session (Store, store.h) is a
// unit store with the extent map, IOCB table, queues and backend on top.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tutti/common.h"
#include "tutti/layout.h"
#include "tutti/options.h"

namespace tutti {

// The memory tier's flush: copies of this many units at once, each unit's objects in this many
// writes in flight (the benches time the disk's write limit in the same shape).
inline constexpr uint32_t kFlushCopiers = 4;
inline constexpr uint32_t kFlushParts = 4;

// The pool and the index are the core's own (native/src/pool.h, index.h).
class FilePool;
class Index;

class UnitStore {
 public:
  // Opens the pool (creating it unless read_only) and rebuilds the index from the slot headers.
  static Status open(const StoreOptions& opt, const Geometry& geom, const std::string& desc,
                     std::unique_ptr<UnitStore>* out);
  virtual ~UnitStore();

  const Geometry& geometry() const { return geom_; }
  uint32_t lookup(const uint64_t* keys, uint32_t n);
  // KV blocks each unit holds: unit_blocks, fewer for a prefix's last, partial unit, 0 when absent.
  void stored_blocks(const uint64_t* keys, uint32_t n, uint32_t* out) const;

  // CPU paths for other nodes and replicas.
  Status read_unit(uint64_t key, std::vector<uint8_t>* out);
  // Reads and verifies a whole GPU file into `dst` (`cap` bytes, at least slot_bytes); in place, with
  // O_DIRECT, when `dst` is 4 KiB aligned.
  Status read_unit_into(uint64_t key, uint8_t* dst, uint64_t cap, bool verify = true);
  // Read-only stores: rescans the headers to see units committed since open.
  Status refresh();
  Status import_unit(const uint8_t* data, uint64_t n, uint64_t* key);

  void pin(const uint64_t* keys, uint32_t n, bool on);
  // Queues each unit lying on storage only for a copy into the memory tier (the flusher's
  // promotion, verified on the way); a pinned unit's memory copy is never demoted. Returns how many
  // were queued (0 without a memory tier or on a read-only store).
  uint32_t promote(const uint64_t* keys, uint32_t n);
  // Drops a unit (*removed: it was present). Refused on a read-only store.
  Status remove(uint64_t key, bool* removed);
  std::vector<uint64_t> keys() const;
  // (inner key, unit key) of every stored unit's inner block keys (layout.h, format 4), flattened.
  std::vector<uint64_t> inner_keys() const;
  virtual StoreStats stats() const;
  // Where each unit lies (memory tier): bit 1 a copy in memory, bit 2 one on storage, 0 absent.
  void unit_tiers(const uint64_t* keys, uint32_t n, uint8_t* out) const;
  // Waits until the background copies are done: no unit waits for its storage copy (write_back)
  // or for its promotion, at most `timeout_s` seconds (< 0: no limit). True when none waits.
  bool flush(double timeout_s = -1);
  // Evicted keys since the last call (for the node daemon and cluster directory).
  std::vector<uint64_t> drain_evicted();
  virtual void close();

 protected:
  UnitStore();
  Status open_units(const StoreOptions& opt, const Geometry& geom, const std::string& desc);
  Status recover();
  // A free slot of tier `t`, evicting when the tier is full:
  // on storage the least recently used unit (both copies), in memory the least recently used
  // unit that has a storage copy (demoted to it), or under memory_only any.
  Status alloc_slot(uint32_t* slot, Tier t = Tier::kStorage);
  // A slot for a new unit: in the memory tier when there is one and it has room, else storage.
  Status alloc_store_slot(uint32_t* slot);
  // A retrieve read `key` from the storage tier: counts it towards promotion. Under mu_.
  void note_storage_hit(uint64_t key);
  // Copies a memory unit to the storage tier (flush) or a storage unit into memory (promotion),
  // objects first and the header (the same bytes: the same key and commit) last, then records the
  // second copy. Not under mu_.
  // False when a flush failed for want of a free storage slot or by a write error: to be tried again.
  bool copy_unit(uint64_t key, Tier to_tier);
  // Under an eighth of the memory tier free.
  bool memory_pressure() const;
  // write_through: copies a unit to storage now, or (that failing) leaves it to the flusher. Not under mu_.
  void flush_now(uint64_t key);
  // A unit left with its memory copy alone (its storage copy dropped as damaged) is flushed again.
  // Under mu_.
  void queue_flush_if_memory_only(uint64_t key);
  void free_slot(uint32_t slot);
  // Overwrites a slot's header with the layout's free-slot header (layout.h), so that a crash while
  // the slot is rewritten never brings the old key back.
  Status invalidate(uint32_t slot) const;
  // A GPU file's size and header (key, layout, blocks, per-object checksums into *sums); verify_unit
  // also checks every object against its checksum.
  // `inner`, when given: the unit's inner keys.
  Status decode_unit(const uint8_t* data, uint64_t n, uint64_t* key, uint32_t* blocks, std::vector<uint64_t>* sums,
                     std::vector<uint64_t>* inner = nullptr) const;
  Status verify_unit(const uint8_t* data, uint64_t n, uint64_t* key, uint32_t* blocks, std::vector<uint64_t>* sums,
                     std::vector<uint64_t>* inner = nullptr) const;
  StoreStats units_stats() const;  // under mu_
  // Commit after write: writes the headers of units whose objects are already in their slots, then
  // makes each unit whose header was written visible under its key (`blocks`: the KV blocks each
  // holds; `sums`: num_objs plain CRC32Cs per unit, in order). Headers go out as one io_uring batch. The
  // one way any unit is committed: an engine's stores and imported replicas alike. Under mu_.
  // committed[i]: unit i is visible.
  // `inner`: each unit's inner block keys (n vectors), or null.
  void commit_units(const uint32_t* slots, const uint64_t* keys, const uint32_t* blocks, const uint64_t* sums,
                    uint32_t n, std::vector<uint8_t>* committed, const std::vector<uint64_t>* inner = nullptr);

  StoreOptions opt_;
  Geometry geom_;
  std::string desc_;
  std::unique_ptr<FilePool> pool_;
  std::unique_ptr<Index> index_;
  std::vector<uint64_t> slot_checksums_;
  std::vector<uint64_t> slot_key_;
  std::unordered_map<uint64_t, std::vector<uint64_t>> inner_of_;  // unit key -> its inner keys, if any
  // The next commit's sequence number: above every header recovery saw, and at least the wall
  // clock in nanoseconds at open, so that a commit outranks units this open could not see (past a
  // lowered capacity, in a pool file or path left out for a while) when they come back.
  uint64_t commit_seq_ = 1;
  mutable std::mutex mu_;
  std::vector<uint64_t> evicted_;
  uint64_t lookups_ = 0, hits_ = 0, evictions_ = 0, checksum_failures_ = 0, io_errors_ = 0, bad_headers_ = 0;
  uint64_t bytes_read_ = 0, bytes_written_ = 0;
  // The memory tier: counters, and the flusher's threads with their queues (under mu_).
  uint64_t memory_hits_ = 0, storage_hits_ = 0, memory_bytes_read_ = 0, promotions_ = 0, demotions_ = 0;
  uint64_t flushes_ = 0, flush_bytes_ = 0, flush_errors_ = 0;
  void flusher_loop();
  void start_flusher();
  void stop_flusher();
  bool settled() const;  // nothing queued, waiting to be tried again, or being copied. Under mu_.
  std::deque<uint64_t> flush_q_, promote_q_, retry_;
  double retry_at_ = 0;  // when retry_ goes back to the flush queue
  uint32_t reading_ = 0;  // the engine session's retrieves in flight: the flusher waits for them
  std::unordered_set<uint64_t> moving_;  // keys being copied between tiers
  std::vector<uint64_t> batch_;  // copies the copiers have taken off a queue and not finished
  std::unordered_map<uint64_t, std::pair<uint32_t, double>> storage_reads_;  // key -> (hits, first hit time)
  std::condition_variable work_cv_, idle_cv_, moved_cv_;
  std::vector<std::thread> flushers_;  // the copiers (flusher_loop)
  bool stop_ = false;
};

}  // namespace tutti
