// The unit store: a share of the node's file pool, its index and the header codec (see unit_store.h).
#include "tutti/unit_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>

#include "header.h"
#include "index.h"
#include "pool.h"
#include "tutti/crc32c.h"

namespace tutti {

namespace {

struct AlignedBuf {
  explicit AlignedBuf(uint64_t n) : size(n) {
    if (posix_memalign(&p, kAlign, align_up(n)) != 0) p = nullptr;
    else std::memset(p, 0, align_up(n));
  }
  ~AlignedBuf() { std::free(p); }
  uint8_t* data() { return static_cast<uint8_t*>(p); }
  void* p = nullptr;
  uint64_t size;
};

}  // namespace

Status UnitStore::open(const StoreOptions& opt, const Geometry& geom, const std::string& desc,
                       std::unique_ptr<UnitStore>* out) {
  std::unique_ptr<UnitStore> s(new UnitStore());
  Status st = s->open_units(opt, geom, desc);
  if (!st.ok()) return st;
  *out = std::move(s);
  return Status::Ok();
}

Status UnitStore::open_units(const StoreOptions& opt, const Geometry& geom, const std::string& desc) {
  opt_ = opt;
  geom_ = geom;
  desc_ = desc;
  PoolFileOptions files;
  files.gid = opt.file_gid;
  files.stamp = !opt.read_only;
  files.desc = desc;
  if (opt.memory_capacity.size() != opt.memory_paths.size())
    return {Code::kConfig, "one capacity per memory tier path is required"};
  // One pool over both tiers: the storage paths, then the memory tier's.
  std::vector<std::string> dirs = opt.paths;
  std::vector<uint64_t> capacity = opt.capacity;
  std::vector<Tier> tiers(dirs.size(), Tier::kStorage);
  dirs.insert(dirs.end(), opt.memory_paths.begin(), opt.memory_paths.end());
  capacity.insert(capacity.end(), opt.memory_capacity.begin(), opt.memory_capacity.end());
  tiers.resize(dirs.size(), Tier::kMemory);
  Status st = pool_->open(dirs, capacity, opt.instance, geom_, opt.direct_io, opt.read_only, opt.pool_files,
                         opt.prewrite_pool, files, tiers);
  if (!st.ok()) return st;
  slot_checksums_.assign(static_cast<uint64_t>(pool_->num_slots()) * geom_.num_objs(), 0);
  slot_key_.assign(pool_->num_slots(), 0);
  st = recover();
  if (!st.ok() || opt.read_only) return st;
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  commit_seq_ = std::max(commit_seq_, static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count()));
  if (pool_->has_memory_tier()) start_flusher();
  return st;
}

UnitStore::UnitStore() : pool_(std::make_unique<FilePool>()), index_(std::make_unique<Index>()) {}

UnitStore::~UnitStore() { UnitStore::close(); }

void UnitStore::close() {
  stop_flusher();  // a copy under way completes; units still in memory only are queued again at the next open
  pool_->close();
}

// Rebuilds the index from the slot headers: only units whose header verifies come back.
Status UnitStore::recover() {
  const Geometry& g = geom_;
  AlignedBuf buf(g.header_bytes);
  if (!buf.p) return {Code::kCapacityExceeded, "out of memory"};
  struct Found {
    uint64_t seq, key;
    uint32_t slot, blocks;
    std::vector<uint64_t> inner;
  };
  std::vector<Found> found;
  std::vector<uint64_t> sums(g.num_objs()), inner;
  uint64_t bad = 0;
  // A writer gives the first slot of every pool file that was never written (all zero), and every
  // older copy of a unit, the free-slot header (layout.h): the file names its layout from now on.
  std::vector<uint8_t> first(pool_->num_slots(), 0);
  std::vector<uint32_t> claim;
  for (uint32_t p = 0; p < pool_->num_paths(); ++p)
    if (pool_->path(p).num_slots) first[pool_->path(p).first_slot] = 1;
  for (uint32_t slot = 0; slot < pool_->num_slots(); ++slot) {
    Status st = pool_->pread_all(slot, 0, buf.data(), g.header_bytes);
    if (!st.ok()) return st;
    uint64_t key, seq;
    uint32_t blocks;
    std::string other;
    switch (decode_header(g, buf.data(), &key, &seq, &blocks, sums.data(), &other, &inner)) {
      case HeaderState::kValid:
        break;
      case HeaderState::kEmpty:
        if (first[slot] && !opt_.read_only && std::all_of(buf.data(), buf.data() + g.header_bytes,
                                                          [](uint8_t b) { return b == 0; }))
          claim.push_back(slot);
        continue;
      case HeaderState::kCorrupt:
        bad++;  // torn or damaged: free space, never a hit
        continue;
      case HeaderState::kOtherLayout:
        // A committed unit of another model or layout: refuse rather than overwrite it.
        return {Code::kLayout, "pool file " + pool_->path(pool_->path_of(slot)).file + " belongs to another layout (" +
                                   other + "; this store is " + layout_text(desc_, g.num_layers, g.unit_blocks) + "); use another instance name or path"};
      case HeaderState::kOldFormat:
        return {Code::kStorage, "pool file " + pool_->path(pool_->path_of(slot)).file +
                                    " was written in pool format 1, whose checksum this build no longer trusts; "
                                    "remove the instance's pool files (tutti-" + opt_.instance +
                                    "*.pool) or use another path or instance name"};
    }
    std::memcpy(&slot_checksums_[static_cast<uint64_t>(slot) * g.num_objs()], sums.data(), sums.size() * 8);
    found.push_back({seq, key, slot, blocks, inner});
  }
  bad_headers_ = bad;
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.seq < b.seq; });
  std::vector<uint8_t> used(pool_->num_slots(), 0);
  std::unordered_map<uint64_t, uint64_t> seq_of;  // key -> the commit its entry holds
  auto drop = [&](uint32_t slot) {  // a writer invalidates it below, or it would come back later
    used[slot] = 0;
    if (!opt_.read_only) claim.push_back(slot);
  };
  for (const Found& f : found) {
    Index::Copies old;
    const bool mem = pool_->tier_of(f.slot) == Tier::kMemory;
    if (index_->find(f.key, &old)) {
      if (seq_of[f.key] == f.seq && old.copy == Index::kNoCopy && old.mem != mem) {
        // The same commit in the other tier: the memory copy serves, the storage copy backs it.
        const uint32_t m = mem ? f.slot : old.slot, s = mem ? old.slot : f.slot;
        index_->insert(f.key, m, f.blocks, true);
        index_->set_copy(f.key, m, s);
        slot_key_[f.slot] = f.key;
        used[f.slot] = 1;
        continue;
      }
      if (seq_of[f.key] == f.seq) {  // a third copy of one commit: never made by a writer
        drop(f.slot);
        continue;
      }
      index_->remove(f.key, &old);  // an older commit of the same unit
      drop(old.slot);
      if (old.copy != Index::kNoCopy) drop(old.copy);
    }
    seq_of[f.key] = f.seq;
    index_->insert(f.key, f.slot, f.blocks, mem);
    if (f.inner.empty()) inner_of_.erase(f.key);
    else inner_of_[f.key] = f.inner;
    slot_key_[f.slot] = f.key;
    used[f.slot] = 1;
    commit_seq_ = std::max(commit_seq_, f.seq + 1);
  }
  pool_->set_used(used);
  for (uint32_t slot : claim) {
    Status st = invalidate(slot);
    if (!st.ok()) return st;
  }
  // Units in memory only (a close or a crash before their flush) wait for their storage copy again.
  if (!opt_.read_only && opt_.write_policy != WritePolicy::kMemoryOnly)
    for (const Found& f : found) {
      Index::Copies c;
      if (index_->find(f.key, &c) && c.mem && c.slot == f.slot && c.copy == Index::kNoCopy) flush_q_.push_back(f.key);
    }
  return Status::Ok();
}

std::vector<uint64_t> UnitStore::keys() const { return index_->keys(); }

std::vector<uint64_t> UnitStore::inner_keys() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<uint64_t> out;
  for (const auto& [key, inner] : inner_of_) {
    if (!index_->contains(key)) continue;
    for (uint64_t k : inner) {
      out.push_back(k);
      out.push_back(key);
    }
  }
  return out;
}

void UnitStore::stored_blocks(const uint64_t* keys, uint32_t n, uint32_t* out) const {
  for (uint32_t i = 0; i < n; ++i) out[i] = index_->blocks(keys[i]);
}

uint32_t UnitStore::lookup(const uint64_t* keys, uint32_t n) {
  uint32_t in_memory = 0;
  uint32_t hit = index_->lookup_prefix(keys, n, &in_memory);
  std::lock_guard<std::mutex> g(mu_);
  lookups_ += n;
  hits_ += hit;
  if (pool_->has_memory_tier()) {
    memory_hits_ += in_memory;
    storage_hits_ += hit - in_memory;
  }
  return hit;
}

void UnitStore::unit_tiers(const uint64_t* keys, uint32_t n, uint8_t* out) const {
  for (uint32_t i = 0; i < n; ++i) {
    Index::Copies c;
    out[i] = !index_->find(keys[i], &c) ? 0 : c.mem ? (c.copy == Index::kNoCopy ? 1 : 3) : 2;
  }
}

// Invalidates a slot's header before it goes back to the free list, so that a crash while the slot is
// rewritten can never bring the old key back over new data.
Status UnitStore::invalidate(uint32_t slot) const {
  AlignedBuf free(geom_.header_bytes);
  if (!free.p) return {Code::kCapacityExceeded, "out of memory"};
  encode_free_header(geom_, desc_, free.data());
  return pool_->pwrite_all(slot, 0, free.data(), geom_.header_bytes);
}

// The one way back to the free list: a free slot never carries a valid header.
void UnitStore::free_slot(uint32_t slot) {
  invalidate(slot);
  pool_->release(slot);
}

Status UnitStore::alloc_slot(uint32_t* slot, Tier t) {
  if (pool_->alloc(slot, t)) return Status::Ok();
  uint64_t key;
  if (t == Tier::kMemory) {
    bool gone;
    if (!index_->evict_memory_lru(opt_.write_policy == WritePolicy::kMemoryOnly, &key, slot, &gone))
      return {Code::kCapacityExceeded, "every memory tier slot holds a unit being read, pinned or not yet on storage"};
    if (gone) {
      evictions_++;
      evicted_.push_back(key);
      inner_of_.erase(key);
    } else {
      demotions_++;
    }
    return invalidate(*slot);
  }
  Index::Copies c;
  if (!index_->evict_lru(&key, &c))
    return {Code::kCapacityExceeded, "every GPU file is pinned or in use; nothing can be evicted"};
  evictions_++;
  evicted_.push_back(key);
  inner_of_.erase(key);
  if (c.copy != Index::kNoCopy) {  // a memory copy and its storage copy: the storage slot is reused
    free_slot(c.slot);
    *slot = c.copy;
  } else {
    *slot = c.slot;
  }
  return invalidate(*slot);
}

Status UnitStore::alloc_store_slot(uint32_t* slot) {
  if (pool_->has_memory_tier()) {
    Status st = alloc_slot(slot, Tier::kMemory);
    if (st.ok() || st.code() != Code::kCapacityExceeded || opt_.write_policy == WritePolicy::kMemoryOnly) return st;
    work_cv_.notify_one();  // memory full of units not yet on storage: this one goes straight there
  }
  return alloc_slot(slot, Tier::kStorage);
}

Status UnitStore::decode_unit(const uint8_t* data, uint64_t n, uint64_t* key, uint32_t* blocks,
                              std::vector<uint64_t>* sums, std::vector<uint64_t>* inner) const {
  const Geometry& g = geom_;
  if (n != g.slot_bytes)
    return {Code::kLayout, "unit is " + std::to_string(n) + " bytes, this layout's GPU file is " + std::to_string(g.slot_bytes)};
  sums->assign(g.num_objs(), 0);
  uint64_t seq;
  switch (decode_header(g, data, key, &seq, blocks, sums->data(), nullptr, inner)) {
    case HeaderState::kValid: break;
    case HeaderState::kOtherLayout: return {Code::kNotFound, "unit is of another layout"};
    default: return {Code::kNotFound, "unit header does not verify"};
  }
  return Status::Ok();
}

Status UnitStore::verify_unit(const uint8_t* data, uint64_t n, uint64_t* key, uint32_t* blocks,
                              std::vector<uint64_t>* sums, std::vector<uint64_t>* inner) const {
  const Geometry& g = geom_;
  Status st = decode_unit(data, n, key, blocks, sums, inner);
  if (!st.ok()) return st;
  for (uint32_t o = 0; o < g.num_objs(); ++o)
    if (crc32c_extend(0, data + g.header_bytes + static_cast<uint64_t>(o) * g.obj_bytes, g.obj_bytes) != (*sums)[o])
      return {Code::kNotFound, "unit object " + std::to_string(o) + " fails its checksum"};
  return Status::Ok();
}

Status UnitStore::read_unit_into(uint64_t key, uint8_t* dst, uint64_t cap, bool verify) {
  const uint64_t n = geom_.slot_bytes;
  if (cap < n) return {Code::kCapacityExceeded, "buffer of " + std::to_string(cap) + " bytes is below one GPU file (" +
                                                    std::to_string(n) + " bytes)"};
  uint32_t slot;
  if (!index_->acquire(key, &slot)) return {Code::kNotFound, "unit not in store"};
  // O_DIRECT needs an aligned buffer: read in place when the caller's is, else bounce.
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % kAlign == 0;
  std::unique_ptr<AlignedBuf> bounce;
  uint8_t* buf = dst;
  Status st;
  if (!aligned) {
    bounce.reset(new AlignedBuf(n));
    buf = bounce->data();
    if (!buf) st = {Code::kCapacityExceeded, "out of memory"};
  }
  if (st.ok()) st = pool_->pread_all(slot, 0, buf, n);
  index_->unpin(key);
  if (!st.ok()) return st;
  uint64_t k;
  uint32_t blocks;
  std::vector<uint64_t> sums;
  // Without verify only the header is checked; the reader then verifies the objects (as
  // scatter_unit and import_unit do) so that each byte is summed once on its way.
  st = verify ? verify_unit(buf, n, &k, &blocks, &sums) : decode_unit(buf, n, &k, &blocks, &sums);
  if (st.ok() && k != key) st = {Code::kNotFound, "unit slot holds another key"};
  if (!st.ok()) return st;
  if (!aligned) std::memcpy(dst, buf, n);
  return Status::Ok();
}

Status UnitStore::read_unit(uint64_t key, std::vector<uint8_t>* out) {
  out->resize(geom_.slot_bytes);
  Status st = read_unit_into(key, out->data(), out->size());
  if (!st.ok()) out->clear();
  return st;
}

Status UnitStore::refresh() {
  if (!opt_.read_only) return {Code::kInvalid, "refresh() is for read-only stores; a writer's index is authoritative"};
  // Under mu_: readers of the per-slot state and the inner keys (inner_keys) take it too.
  std::lock_guard<std::mutex> lk(mu_);
  for (uint64_t key : index_->keys()) {
    Index::Copies c;
    index_->remove(key, &c);
  }
  inner_of_.clear();
  return recover();
}

Status UnitStore::import_unit(const uint8_t* data, uint64_t n, uint64_t* key) {
  if (opt_.read_only) return {Code::kInvalid, "store opened read-only: import units into the engine's store"};
  std::vector<uint64_t> sums, inner;
  uint32_t blocks;
  Status st = verify_unit(data, n, key, &blocks, &sums, &inner);
  if (!st.ok()) return st;
  std::unique_lock<std::mutex> lk(mu_);
  if (index_->contains(*key)) return Status::Ok();
  uint32_t slot;
  st = alloc_store_slot(&slot);
  if (!st.ok()) return st;
  AlignedBuf buf(n);
  if (!buf.p) {
    pool_->release(slot);
    return {Code::kCapacityExceeded, "out of memory"};
  }
  std::memcpy(buf.data(), data, n);
  // Objects first, header last.
  const uint64_t hb = geom_.header_bytes;
  st = pool_->pwrite_all(slot, hb, buf.data() + hb, n - hb);
  if (st.ok()) {
    std::vector<uint8_t> done;
    commit_units(&slot, key, &blocks, sums.data(), 1, &done, &inner);  // a replica keeps its inner keys
    if (!done[0]) st = {Code::kStorage, "writing the unit's header failed"};
  }
  if (!st.ok()) {
    free_slot(slot);
    return st;
  }
  lk.unlock();
  if (opt_.write_policy == WritePolicy::kWriteThrough && pool_->tier_of(slot) == Tier::kMemory)
    flush_now(*key);
  return st;
}

void UnitStore::commit_units(const uint32_t* slots, const uint64_t* keys, const uint32_t* blocks, const uint64_t* sums,
                             uint32_t n, std::vector<uint8_t>* committed, const std::vector<uint64_t>* inner) {
  const Geometry& g = geom_;
  committed->assign(n, 0);
  if (n == 0) return;
  AlignedBuf hdrs(static_cast<uint64_t>(n) * g.header_bytes);
  if (!hdrs.p) return;  // nothing committed: every unit is reported not stored
  // New sequence numbers: recovery keeps the newest commit of a key. kept[i]: the inner keys the
  // header holds.
  std::vector<uint32_t> kept(n);
  for (uint32_t i = 0; i < n; ++i)
    kept[i] = encode_header(g, desc_, keys[i], commit_seq_++, blocks[i], sums + static_cast<uint64_t>(i) * g.num_objs(),
                            hdrs.data() + static_cast<uint64_t>(i) * g.header_bytes, inner ? inner[i].data() : nullptr,
                            inner ? static_cast<uint32_t>(inner[i].size()) : 0);
  // One small write per unit, each to its own slot, all in flight at once.
  pool_->write_slot_heads(slots, hdrs.data(), g.header_bytes, n, committed->data());
  for (uint32_t i = 0; i < n; ++i) {
    if (!(*committed)[i]) continue;
    std::memcpy(&slot_checksums_[static_cast<uint64_t>(slots[i]) * g.num_objs()], sums + static_cast<uint64_t>(i) * g.num_objs(),
                g.num_objs() * sizeof(uint64_t));
    slot_key_[slots[i]] = keys[i];
    const bool mem = pool_->tier_of(slots[i]) == Tier::kMemory;
    index_->insert(keys[i], slots[i], blocks[i], mem);
    if (mem && opt_.write_policy == WritePolicy::kWriteBack) {  // write_through: the caller copies it
      flush_q_.push_back(keys[i]);
      work_cv_.notify_one();
    }
    if (kept[i]) inner_of_[keys[i]].assign(inner[i].begin(), inner[i].begin() + kept[i]);
    else inner_of_.erase(keys[i]);
    bytes_written_ += g.slot_bytes;
  }
}

void UnitStore::pin(const uint64_t* keys, uint32_t n, bool on) {
  for (uint32_t i = 0; i < n; ++i) {
    if (on) index_->pin(keys[i]);
    else index_->unpin(keys[i]);
  }
}

uint32_t UnitStore::promote(const uint64_t* keys, uint32_t n) {
  if (!pool_->has_memory_tier() || opt_.read_only) return 0;
  std::lock_guard<std::mutex> lk(mu_);
  uint32_t queued = 0;
  for (uint32_t i = 0; i < n; ++i) {
    Index::Copies c;
    if (!index_->find(keys[i], &c) || c.mem) continue;
    auto has = [&](const auto& v) { return std::find(v.begin(), v.end(), keys[i]) != v.end(); };
    if (has(promote_q_) || has(batch_)) continue;
    promote_q_.push_back(keys[i]);
    queued++;
  }
  if (queued) work_cv_.notify_one();
  return queued;
}

Status UnitStore::remove(uint64_t key, bool* removed) {
  *removed = false;
  if (opt_.read_only) return {Code::kInvalid, "store opened read-only: remove units through the engine that owns them"};
  std::unique_lock<std::mutex> lk(mu_);
  // A copy between tiers pins the unit only while it runs: wait for it rather than refuse.
  moved_cv_.wait(lk, [&] { return moving_.count(key) == 0; });
  Index::Copies c;
  const uint32_t blocks = index_->blocks(key);
  // A pinned unit stays: pinned by its owner, or read by a retrieve whose slot must not be reused.
  if (index_->remove_unpinned(key, &c) != Index::Removed::kGone) return Status::Ok();
  inner_of_.erase(key);
  // The headers go first, the storage copy's first: a unit whose header cannot be cleared stays
  // (it would come back at the next open otherwise).
  for (uint32_t slot : {c.copy, c.slot}) {
    if (slot == Index::kNoCopy) continue;
    Status st = invalidate(slot);
    if (!st.ok()) {
      index_->insert(key, slot, blocks, pool_->tier_of(slot) == Tier::kMemory);
      return st;
    }
    pool_->release(slot);
  }
  *removed = true;
  return Status::Ok();
}

std::vector<uint64_t> UnitStore::drain_evicted() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<uint64_t> out;
  out.swap(evicted_);
  return out;
}

StoreStats UnitStore::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return units_stats();
}

StoreStats UnitStore::units_stats() const {
  StoreStats s;
  s.memory_units = index_->in_memory();
  s.memory_slots = pool_->num_slots(Tier::kMemory);
  s.memory_free_slots = pool_->free_slots(Tier::kMemory);
  s.memory_hits = memory_hits_;
  s.storage_hits = storage_hits_;
  s.memory_bytes_read = memory_bytes_read_;
  s.promotions = promotions_;
  s.demotions = demotions_;
  s.flushes = flushes_;
  s.flush_bytes = flush_bytes_;
  s.flush_errors = flush_errors_;
  s.flush_backlog = flush_q_.size() + retry_.size() + moving_.size();
  s.units = index_->size();
  s.pinned = index_->pinned();
  s.free_slots = pool_->free_slots();
  s.total_slots = pool_->num_slots();
  s.hits = hits_;
  s.lookups = lookups_;
  s.evictions = evictions_;
  s.checksum_failures = checksum_failures_;
  s.io_errors = io_errors_;
  s.bad_headers = bad_headers_;
  s.bytes_read = bytes_read_;
  s.bytes_written = bytes_written_;
  s.slot_bytes = geom_.slot_bytes;
  s.obj_bytes = geom_.obj_bytes;
  s.direct_io = pool_->num_paths() > 0 && pool_->path(0).direct;
  s.backend = "none";
  return s;
}

// ---- The memory tier: flushes and promotions, on background threads -----------------------------

static double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// kFlushCopiers copies at a time: one unit's own steps (mapping, verifying, the header's write)
// overlap the others' object writes, and the disk sees more writes in flight. Each copier takes its
// next unit as soon as its last one is done (batches of four, each waiting for its slowest, left
// the disk with fewer writes at the end of every batch).
void UnitStore::start_flusher() {
  if (opt_.read_only || !flushers_.empty()) return;
  stop_ = false;
  for (uint32_t i = 0; i < kFlushCopiers; ++i) flushers_.emplace_back([this] { flusher_loop(); });
}

void UnitStore::stop_flusher() {
  if (flushers_.empty()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : flushers_) t.join();
  flushers_.clear();
  idle_cv_.notify_all();
}

// One copier. Flushes go first: a unit in memory only is one crash of the host away from being
// lost. Up to kFlushCopiers copies run at once, one beside the engine's retrieves (whose reads keep
// the disk). Copies go in the storage tier's slack: while retrieves are in flight a copier waits,
// 50 ms at a time, unless the memory tier is under pressure (under an eighth of it free). Copies
// that failed (storage full of pinned units, a write error) are tried again each second.
void UnitStore::flusher_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  bool waited = false;  // for the retrieves in flight, once before this copy
  while (!stop_) {
    if (!retry_.empty() && now_s() >= retry_at_) {
      flush_q_.insert(flush_q_.end(), retry_.begin(), retry_.end());
      retry_.clear();
    }
    const bool work = !flush_q_.empty() || !promote_q_.empty();
    if (!work || batch_.size() >= (reading_ > 0 ? 1 : kFlushCopiers)) {
      if (retry_.empty()) work_cv_.wait(lk);
      else work_cv_.wait_for(lk, std::chrono::duration<double>(std::max(0.0, retry_at_ - now_s())));
      continue;
    }
    if (reading_ > 0 && !memory_pressure() && !waited) {
      work_cv_.wait_for(lk, std::chrono::milliseconds(50), [this] { return stop_ || reading_ == 0; });
      waited = true;
      continue;
    }
    waited = false;
    const bool flush = !flush_q_.empty();
    std::deque<uint64_t>& q = flush ? flush_q_ : promote_q_;
    const uint64_t key = q.front();
    q.pop_front();
    batch_.push_back(key);
    lk.unlock();
    const bool done = copy_unit(key, flush ? Tier::kStorage : Tier::kMemory);
    lk.lock();
    batch_.erase(std::find(batch_.begin(), batch_.end(), key));
    if (!done) {
      if (retry_.empty()) retry_at_ = now_s() + 1.0;
      retry_.push_back(key);
    }
    work_cv_.notify_all();  // a copier held back by the limit may go
    if (settled()) idle_cv_.notify_all();
  }
}

bool UnitStore::memory_pressure() const {
  return pool_->free_slots(Tier::kMemory) * 8 < pool_->num_slots(Tier::kMemory);
}

bool UnitStore::settled() const {
  return flush_q_.empty() && promote_q_.empty() && retry_.empty() && moving_.empty() && batch_.empty();
}

bool UnitStore::flush(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto idle = [&] { return stop_ || flushers_.empty() || settled(); };
  if (!(timeout_s >= 0) || timeout_s > 1e7) idle_cv_.wait(lk, idle);  // < 0, NaN, or beyond any wait: no limit
  else idle_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), idle);
  return settled();
}

void UnitStore::flush_now(uint64_t key) {
  if (copy_unit(key, Tier::kStorage)) return;
  std::lock_guard<std::mutex> lk(mu_);  // failed: the flusher tries again
  flush_q_.push_back(key);
  work_cv_.notify_one();
}

void UnitStore::queue_flush_if_memory_only(uint64_t key) {
  Index::Copies c;
  if (opt_.write_policy == WritePolicy::kMemoryOnly || !index_->find(key, &c) || !c.mem || c.copy != Index::kNoCopy)
    return;
  flush_q_.push_back(key);
  work_cv_.notify_one();
}

void UnitStore::note_storage_hit(uint64_t key) {
  if (opt_.promote_hits == 0 || !pool_->has_memory_tier() || opt_.read_only) return;
  const double now = now_s();
  if (storage_reads_.size() >= (1u << 16)) {  // bounded: forget the hits older than the window, or all
    for (auto it = storage_reads_.begin(); it != storage_reads_.end();)
      it = now - it->second.second > opt_.promote_window_s ? storage_reads_.erase(it) : std::next(it);
    if (storage_reads_.size() >= (1u << 15)) storage_reads_.clear();  // a scan this long: start counting again
  }
  auto& [hits, first] = storage_reads_[key];
  if (hits == 0 || now - first > opt_.promote_window_s) {
    hits = 0;
    first = now;
  }
  if (++hits < opt_.promote_hits) return;
  storage_reads_.erase(key);
  promote_q_.push_back(key);
  work_cv_.notify_one();
}

// Copies the GPU file in slot `from` to slot `to` (another tier): objects, then the header, the
// same bytes, so the copy is the same commit. A memory-tier source is read through a mapping of its
// slot of its own (never the I/O kernel's, which the engine session makes and removes on its own
// schedule), a storage source with pread into a buffer of one GPU file. The objects' write runs on a second thread
// while this one verifies them (a damaged source is never committed: its header is not written).
// Not under mu_.
static Status copy_slot(FilePool& pool, const Geometry& g, uint32_t from, uint32_t to,
                        const std::function<Status(const uint8_t*)>& verify) {
  const PoolPath& src = pool.path(pool.path_of(from));
  const uint8_t* data = nullptr;
  void* map = MAP_FAILED;
  if (src.huge_page && src.map) {
    data = src.map + pool.offset_of(from);  // hugetlbfs: mapped whole at open, before any other thread ran
  } else if (src.memory) {
    map = ::mmap(nullptr, g.slot_bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, src.fd,
                 static_cast<off_t>(pool.offset_of(from)));
    if (map != MAP_FAILED) data = static_cast<const uint8_t*>(map);
  }
  std::unique_ptr<AlignedBuf> buf;
  Status st;
  if (!data) {
    buf = std::make_unique<AlignedBuf>(g.slot_bytes);
    data = buf->data();
    st = data ? pool.pread_all(from, 0, buf->data(), g.slot_bytes) : Status{Code::kCapacityExceeded, "out of memory"};
  }
  if (st.ok()) {
    // kFlushParts writes in flight: one synchronous stream of 32 MiB writes moved 0.65-0.8x of what four
    // streams of 8 MiB did on the 2-core VM's disk (tools/diag/flush_bandwidth.py measures the flush).
    const uint64_t body = g.slot_bytes - g.header_bytes, part = (body / kFlushParts + kAlign - 1) / kAlign * kAlign;
    std::vector<std::future<Status>> writes;
    for (uint64_t off = 0; off < body; off += part) {
      const uint64_t n = std::min(part, body - off);
      writes.push_back(std::async(std::launch::async, [&pool, &g, to, data, off, n] {
        return pool.pwrite_all(to, g.header_bytes + off, data + g.header_bytes + off, n);
      }));
    }
    Status v = verify(data);
    for (auto& w : writes) {
      Status ws = w.get();
      if (st.ok() && !ws.ok()) st = ws;
    }
    if (!v.ok()) st = v;
  }
  if (st.ok()) st = pool.pwrite_all(to, 0, data, g.header_bytes);
  if (map != MAP_FAILED) ::munmap(map, g.slot_bytes);
  return st;
}

// A flush (to the storage tier: the unit must lie in memory only) or a promotion (to memory: the
// unit must lie on storage only). The source is pinned while it is read; the copy is recorded only
// if the unit still lies where it did, else its slot is freed again.
bool UnitStore::copy_unit(uint64_t key, Tier to_tier) {
  const bool flush = to_tier == Tier::kStorage;
  uint32_t from, to;
  {
    std::lock_guard<std::mutex> lk(mu_);
    Index::Copies c;
    if (moving_.count(key) || !index_->find(key, &c) || c.mem != flush || c.copy != Index::kNoCopy) return true;
    if (!alloc_slot(&to, to_tier).ok()) {
      if (!flush) return true;  // no room in memory without dropping a unit in memory only: not promoted
      flush_errors_++;  // storage full of pinned units: the unit stays in memory only, for now
      return false;
    }
    from = c.slot;
    index_->pin(key);
    moving_.insert(key);
  }
  bool damaged = false;
  auto verify = [&](const uint8_t* d) {
    uint64_t k;
    uint32_t blocks;
    std::vector<uint64_t> sums;
    Status v = verify_unit(d, geom_.slot_bytes, &k, &blocks, &sums);
    if (v.ok() && k != key) v = {Code::kNotFound, "slot holds another key"};
    damaged = !v.ok();
    return v;
  };
  Status st = copy_slot(*pool_, geom_, from, to, verify);
  std::lock_guard<std::mutex> lk(mu_);
  index_->unpin(key);
  moving_.erase(key);
  moved_cv_.notify_all();
  if (st.ok() && (flush ? index_->set_copy(key, from, to) : index_->promote(key, from, to))) {
    std::memcpy(&slot_checksums_[static_cast<uint64_t>(to) * geom_.num_objs()],
                &slot_checksums_[static_cast<uint64_t>(from) * geom_.num_objs()], geom_.num_objs() * sizeof(uint64_t));
    slot_key_[to] = key;
    if (flush) {
      flushes_++;
      flush_bytes_ += geom_.slot_bytes;
      bytes_written_ += geom_.slot_bytes;
    } else {
      promotions_++;
    }
    return true;
  }
  free_slot(to);
  if (st.ok()) return true;  // removed or replaced meanwhile
  if (flush) flush_errors_++;
  bool gone;
  if (damaged && index_->drop_copy(key, from, &gone)) {  // a damaged copy is a miss; the other serves
    checksum_failures_++;
    free_slot(from);
    if (gone) {
      evicted_.push_back(key);
      inner_of_.erase(key);
    }
  }
  return !flush || damaged;  // a flush that failed otherwise (a write error) is tried again
}

}  // namespace tutti
