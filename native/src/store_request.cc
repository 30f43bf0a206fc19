// The engine session's request lifecycle (store.h): begin, the per-layer calls, done and finish.
#include "tutti/store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "backend.h"
#include "extent.h"
#include "gio_queue.h"
#include "index.h"
#include "pool.h"

namespace tutti {

const char* unit_fail_cause_name(UnitFailCause c) {
  switch (c) {
    case UnitFailCause::kChecksum: return "checksum";
    case UnitFailCause::kIoError: return "io_error";
    case UnitFailCause::kNotPresent: return "not_present";
    case UnitFailCause::kTooFewBlocks: return "too_few_blocks";
    case UnitFailCause::kNoFreeSlot: return "no_free_slot";
    case UnitFailCause::kIncompleteLayers: return "incomplete_layers";
    case UnitFailCause::kDeviceError: return "device_error";
    case UnitFailCause::kCommitFailed: return "commit_failed";
  }
  return "unknown";
}

Status Store::begin(ReqOp op, const uint64_t* keys, uint32_t n_units, const int64_t* block_ids, uint64_t n_blocks,
                    uint32_t* request, const uint64_t* inner, const uint32_t* n_inner) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  const Geometry& g = geom_;
  // Every unit is whole but the last, which holds 1 to unit_blocks blocks (a prefix's partial tail).
  const uint64_t whole = n_units ? static_cast<uint64_t>(n_units - 1) * g.unit_blocks : 0;
  if (n_units ? n_blocks <= whole || n_blocks > whole + g.unit_blocks : n_blocks != 0)
    return {Code::kLayout, "got " + std::to_string(n_blocks) + " block ids for " + std::to_string(n_units) +
                               " units of " + std::to_string(g.unit_blocks) + " blocks (only the last may hold fewer)"};
  std::lock_guard<std::mutex> lk(mu_);
  uint32_t id = 0;
  while (id < requests_.size() && requests_[id].active) ++id;
  if (id == requests_.size()) return {Code::kCapacityExceeded, "too many requests in flight"};
  // Every IOCB the request will post, checked before anything is taken or evicted: a layer call
  // cannot then fail half-way for want of one (they are taken below, under the same lock).
  const uint64_t nctx = static_cast<uint64_t>(n_units) * g.objs_per_layer;
  const uint32_t per_layer = static_cast<uint32_t>((nctx + kMaxIoctxPerIocb - 1) / kMaxIoctxPerIocb);
  const uint64_t need = static_cast<uint64_t>(per_layer) * g.num_layers;
  if (need > free_iocbs_.size())
    return {Code::kCapacityExceeded, "IOCB table exhausted: the request needs " + std::to_string(need) + " IOCBs, " +
                                         std::to_string(free_iocbs_.size()) + " of " + std::to_string(num_iocbs_) +
                                         " are free (raise iocb_depth, or finish requests in flight)"};
  Request& r = requests_[id];
  r = Request{};
  r.op = op;
  r.keys.assign(keys, keys + n_units);
  r.unit_slot.assign(n_units, kNoSlot);
  r.unit_present.assign(n_units, 0);
  r.unit_failed.assign(n_units, 0);
  r.unit_errno.assign(n_units, 0);
  r.unit_cause.assign(n_units, 0);
  r.unit_blocks.assign(n_units, g.unit_blocks);
  if (n_units) r.unit_blocks.back() = static_cast<uint32_t>(n_blocks - whole);
  if (n_inner && op == ReqOp::kStore) {
    r.inner.resize(n_units);
    for (uint32_t u = 0, at = 0; u < n_units; at += n_inner[u++]) r.inner[u].assign(inner + at, inner + at + n_inner[u]);
  }
  std::vector<std::pair<uint32_t, uint32_t>> unit_ext(n_units);
  for (uint32_t u = 0; u < n_units; ++u) {
    uint32_t first = static_cast<uint32_t>(r.extents.size());
    Status st = extents_->build(block_ids + static_cast<uint64_t>(u) * g.unit_blocks, r.unit_blocks[u], &r.extents,
                               op == ReqOp::kRetrieve);
    if (!st.ok()) return st;
    unit_ext[u] = {first, static_cast<uint32_t>(r.extents.size()) - first};
  }
  if (op == ReqOp::kRetrieve) {
    Status st = extents_->check_distinct(r.extents);
    if (!st.ok()) return st;
  }
  for (uint32_t u = 0; u < n_units; ++u) {
    if (op == ReqOp::kRetrieve) {
      uint32_t held = 0;
      if (index_->acquire(keys[u], &r.unit_slot[u], &held) && held >= r.unit_blocks[u]) {
        r.unit_present[u] = 1;
        if (pool_->tier_of(r.unit_slot[u]) == Tier::kStorage) note_storage_hit(keys[u]);
      } else {
        // Evicted since lookup, or a partial unit asked for more blocks than it holds: a miss.
        if (held) index_->unpin(keys[u]);
        r.unit_slot[u] = kNoSlot;
        r.unit_failed[u] = 1;
        r.unit_cause[u] = static_cast<uint8_t>(held ? UnitFailCause::kTooFewBlocks : UnitFailCause::kNotPresent);
      }
    } else {
      bool dup = index_->contains(keys[u]) || std::find(keys, keys + u, keys[u]) != keys + u;
      if (dup) {
        r.skipped++;
        continue;
      }
      Status st = alloc_store_slot(&r.unit_slot[u]);
      if (!st.ok()) {
        if (st.code() != Code::kCapacityExceeded) {
          release_request(id, r);
          return st;
        }
        r.unit_failed[u] = 1;
        r.unit_cause[u] = static_cast<uint8_t>(UnitFailCause::kNoFreeSlot);
        r.unit_slot[u] = kNoSlot;
        continue;
      }
      r.unit_present[u] = 1;
    }
  }
  r.ctx.reserve(static_cast<uint64_t>(n_units) * g.objs_per_layer);
  for (uint32_t u = 0; u < n_units; ++u) {
    const uint32_t slot = r.unit_slot[u];
    for (uint32_t o = 0; o < g.objs_per_layer; ++o) {
      Ioctx x{};
      x.slot = slot;
      x.unit = u;
      x.obj = o;
      if (slot != kNoSlot) {
        x.path = pool_->path_of(slot);
        x.file_offset = pool_->offset_of(slot);
      }
      x.extent_first = unit_ext[u].first;
      x.extent_count = unit_ext[u].second;
      r.ctx.push_back(x);
    }
  }
  // Retrieve: the expected checksum of every object; store: filled in by the kernel.
  r.checksums.assign(static_cast<uint64_t>(n_units) * g.num_objs(), 0);
  if (op == ReqOp::kRetrieve)
    for (uint32_t u = 0; u < n_units; ++u)
      if (r.unit_slot[u] != kNoSlot)
        std::memcpy(&r.checksums[static_cast<uint64_t>(u) * g.num_objs()],
                    &slot_checksums_[static_cast<uint64_t>(r.unit_slot[u]) * g.num_objs()], g.num_objs() * sizeof(uint64_t));
  r.layer_iocbs.assign(g.num_layers, {});
  r.layer_issued.assign(g.num_layers, 0);
  r.raw_done.assign(g.num_layers, {});
  r.layer_failed.assign(g.num_layers, 0);
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    take_iocbs(per_layer, id, &r.layer_iocbs[l]);
    for (uint32_t i = 0; i < per_layer; ++i) {
      Iocb& b = iocbs_[r.layer_iocbs[l][i]];
      b.op = static_cast<uint32_t>(op == ReqOp::kRetrieve ? IoOp::kRead : IoOp::kWrite);
      b.layer = l;
      b.request = id;
      b.ctx_first = i * kMaxIoctxPerIocb;
      b.ctx_count = static_cast<uint32_t>(std::min<uint64_t>(kMaxIoctxPerIocb, nctx - uint64_t(i) * kMaxIoctxPerIocb));
    }
  }
  RequestView& v = views_[id];
  v.ctx = r.ctx.data();
  v.extents = r.extents.data();
  v.checksums = r.checksums.data();
  v.unit_failed = r.unit_failed.data();
  v.unit_errno = r.unit_errno.data();
  v.num_units = n_units;
  const uint64_t map_bytes = r.extents.size() * sizeof(Extent) + r.ctx.size() * sizeof(Ioctx) +
                             r.checksums.size() * sizeof(uint64_t) + n_units * (sizeof(uint64_t) + sizeof(uint32_t) + 2);
  request_map_peak_ = std::max(request_map_peak_, map_bytes);
  Status st = backend_->begin_request(id, &v);
  if (!st.ok()) {
    release_request(id, r);
    return st;
  }
  r.active = true;
  if (op == ReqOp::kRetrieve) reading_++;
  *request = id;
  return Status::Ok();
}

Status Store::layer(uint32_t layer, uint32_t id, uint64_t event, int64_t stream) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!open_request(id)) return {Code::kInvalid, "no request " + std::to_string(id) + " in flight"};
  Request& r = requests_[id];
  if (layer >= geom_.num_layers)
    return {Code::kLayout, "layer " + std::to_string(layer) + " out of range [0, " + std::to_string(geom_.num_layers) + ")"};
  if (r.layer_issued[layer] || r.layer_failed[layer])
    return {Code::kInvalid, "layer " + std::to_string(layer) + " already issued for this request"};
  const std::vector<uint32_t>& ids = r.layer_iocbs[layer];
  if (!ids.empty() && !event && stream >= 0) {
    // Recorded and waited on under mu_, back to back: one reusable event serves every layer.
    Status st = backend_->record_on(static_cast<uint64_t>(stream), &event);
    if (!st.ok()) {
      r.layer_failed[layer] = 1;
      return st;
    }
  }
  Status st = ids.empty() ? Status::Ok() : issue_locked(ids.data(), static_cast<uint32_t>(ids.size()), 0, event);
  if (!st.ok()) {
    r.layer_failed[layer] = 1;  // finish reports the whole request failed
    return st;
  }
  r.layer_issued[layer] = 1;
  return Status::Ok();
}

Status Store::wait_layer(uint32_t layer, uint32_t id, uint64_t stream) {
  std::vector<uint32_t> ids;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!open_request(id)) return {Code::kInvalid, "no request " + std::to_string(id) + " in flight"};
    Request& r = requests_[id];
    if (layer >= geom_.num_layers) return {Code::kLayout, "layer " + std::to_string(layer) + " out of range"};
    if (!r.layer_issued[layer]) return {Code::kInvalid, "layer " + std::to_string(layer) + " was not issued"};
    ids = r.layer_iocbs[layer];
  }
  if (stream != 0 && backend_->stream_wait(ids.data(), static_cast<uint32_t>(ids.size()), stream)) return Status::Ok();
  for (uint32_t b : ids) wait_done(b);
  return Status::Ok();
}

// Under mu_, with none of the request's IOCBs in flight.
void Store::release_request(uint32_t id, Request& r) {
  for (auto& ids : r.layer_iocbs)
    for (uint32_t b : ids) give_back_iocb(b);
  for (uint32_t b : r.raw_iocbs) iocbs_[b].ctx_count = 0;  // still the caller's, pointing nowhere
  if (r.op == ReqOp::kRetrieve) {
    for (uint32_t u = 0; u < r.keys.size(); ++u)
      if (r.unit_present[u]) index_->unpin(r.keys[u]);
    if (r.active && reading_ > 0 && --reading_ == 0) work_cv_.notify_all();  // the flusher's turn
  } else {
    for (uint32_t u = 0; u < r.keys.size(); ++u)
      if (r.unit_present[u] && r.unit_slot[u] != kNoSlot) pool_->release(r.unit_slot[u]);
  }
  views_[id] = RequestView{};
  r = Request{};
}

// A layer is complete when its own IOCBs ran, or gio_uring IOCBs moved every IOCTX of it.
bool Store::layer_complete(const Request& r, uint32_t layer) const {
  if (r.layer_issued[layer] && !r.layer_failed[layer]) return true;
  std::vector<std::pair<uint32_t, uint32_t>> v = r.raw_done[layer];
  if (r.ctx.empty() || v.empty()) return false;
  std::sort(v.begin(), v.end());
  uint64_t end = 0;
  for (const auto& [first, count] : v) {
    if (first > end) return false;
    end = std::max<uint64_t>(end, static_cast<uint64_t>(first) + count);
  }
  return end >= r.ctx.size();
}

std::vector<uint32_t> Store::issued_iocbs(const Request& r) const {
  std::vector<uint32_t> ids;
  for (uint32_t l = 0; l < r.layer_iocbs.size(); ++l)
    if (r.layer_issued[l]) ids.insert(ids.end(), r.layer_iocbs[l].begin(), r.layer_iocbs[l].end());
  // IOCBs of the gio_uring API that still read this request: it is released only after them.
  ids.insert(ids.end(), r.raw_iocbs.begin(), r.raw_iocbs.end());
  return ids;
}

Status Store::done(uint32_t id, bool* out) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!open_request(id)) return {Code::kInvalid, "no request " + std::to_string(id) + " in flight"};
  const std::vector<uint32_t> ids = issued_iocbs(requests_[id]);
  *out = std::none_of(ids.begin(), ids.end(), [this](uint32_t b) { return in_flight(b); });
  return Status::Ok();
}

Status Store::finish(uint32_t id, RequestResult* out) {
  std::vector<uint32_t> wait_ids;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!open_request(id)) return {Code::kInvalid, "no request " + std::to_string(id) + " in flight"};
    Request& r = requests_[id];
    // From here on nothing more is issued against it (layer calls and gio_uring IOCBs are refused),
    // so the IOCBs waited for below are all that can still read it.
    r.finishing = true;
    wait_ids = issued_iocbs(r);
  }
  for (uint32_t b : wait_ids) wait_done(b);
  std::vector<uint64_t> through;  // write_through: committed into memory, copied to storage before we return
  std::unique_lock<std::mutex> lk(mu_);
  Request& r = requests_[id];
  for (uint32_t b : r.raw_iocbs) settle_raw(b);
  const Geometry& g = geom_;
  const uint32_t n = static_cast<uint32_t>(r.keys.size());
  out->units = n;
  out->skipped_units = r.skipped;
  out->failed_units.clear();
  out->failures.clear();
  out->committed_units.clear();
  out->incomplete_layers.clear();
  for (uint32_t l = 0; l < g.num_layers; ++l)
    if (!layer_complete(r, l)) out->incomplete_layers.push_back(l);
  // A unit the kernel could not vouch for (device failure, layers missing) failed, but is not damaged.
  std::vector<uint8_t> not_moved(n, 0);
  Status est = backend_->end_request(id, &views_[id]);
  if (!est.ok() || !out->incomplete_layers.empty())
    for (uint32_t u = 0; u < n; ++u) not_moved[u] = r.unit_present[u];
  // Causes the kernel left (1 an I/O error, 2 a checksum mismatch), or a unit it could not vouch for.
  const UnitFailCause unmoved = est.ok() ? UnitFailCause::kIncompleteLayers : UnitFailCause::kDeviceError;
  for (uint32_t u = 0; u < n; ++u) {
    if (r.unit_failed[u] == 2) checksum_failures_++;
    else if (r.unit_failed[u] == 1 && r.unit_slot[u] != kNoSlot) io_errors_++;
    if (r.unit_cause[u]) continue;  // found at begin: no slot
    if (r.unit_failed[u] == 2) r.unit_cause[u] = static_cast<uint8_t>(UnitFailCause::kChecksum);
    else if (r.unit_failed[u]) r.unit_cause[u] = static_cast<uint8_t>(UnitFailCause::kIoError);
    else if (not_moved[u]) r.unit_cause[u] = static_cast<uint8_t>(unmoved);
  }
  if (r.op == ReqOp::kStore && n > 0) {
    // Commit after write: a unit's header goes out only now that every object of it is on storage,
    // and only for units whose every layer was written and checksummed (UnitStore::commit_units,
    // the one way any unit becomes visible).
    std::vector<uint32_t> units, slots, blocks;
    std::vector<uint64_t> keys, sums;
    std::vector<std::vector<uint64_t>> inner;
    for (uint32_t u = 0; u < n; ++u) {
      if (!r.unit_present[u]) continue;
      if (not_moved[u]) r.unit_failed[u] |= 1;
      if (r.unit_failed[u] || index_->contains(r.keys[u])) {
        invalidate(r.unit_slot[u]);
        continue;  // released below
      }
      units.push_back(u);
      slots.push_back(r.unit_slot[u]);
      keys.push_back(r.keys[u]);
      blocks.push_back(r.unit_blocks[u]);
      if (!r.inner.empty()) inner.push_back(r.inner[u]);
      sums.insert(sums.end(), r.checksums.begin() + static_cast<int64_t>(u) * g.num_objs(),
                  r.checksums.begin() + static_cast<int64_t>(u + 1) * g.num_objs());
    }
    std::vector<uint8_t> committed;
    commit_units(slots.data(), keys.data(), blocks.data(), sums.data(), static_cast<uint32_t>(units.size()), &committed,
                 inner.empty() ? nullptr : inner.data());
    for (uint32_t i = 0; i < units.size(); ++i) {
      const uint32_t u = units[i];
      if (!committed[i]) {
        r.unit_failed[u] |= 1;
        r.unit_cause[u] = static_cast<uint8_t>(UnitFailCause::kCommitFailed);
        io_errors_++;
        invalidate(r.unit_slot[u]);
        continue;  // released below
      }
      r.unit_present[u] = 0;  // now owned by the index
      out->committed_units.push_back(u);
      if (opt_.write_policy == WritePolicy::kWriteThrough && pool_->tier_of(r.unit_slot[u]) == Tier::kMemory)
        through.push_back(r.keys[u]);
    }
  } else if (r.op == ReqOp::kRetrieve) {
    for (uint32_t u = 0; u < n; ++u) {
      if (!r.unit_present[u]) continue;
      if (r.unit_failed[u]) {
        // Drop the damaged copy: unpin, invalidate, free; unless the key has moved to another
        // slot since (removed and stored again: that entry is not this damage). The unit stays
        // while its other tier's copy does (read from there next time).
        index_->unpin(r.keys[u]);
        r.unit_present[u] = 0;
        bool gone;
        if (index_->drop_copy(r.keys[u], r.unit_slot[u], &gone)) {
          free_slot(r.unit_slot[u]);
          if (gone) {
            evicted_.push_back(r.keys[u]);
            inner_of_.erase(r.keys[u]);
          } else {
            queue_flush_if_memory_only(r.keys[u]);
          }
        }
      } else if (not_moved[u]) {
        r.unit_failed[u] = 3;  // a miss; the unit stays (unpinned below)
      } else {
        const uint64_t bytes = static_cast<uint64_t>(r.unit_blocks[u]) * g.block_bytes * g.num_objs();
        bytes_read_ += bytes;
        if (pool_->tier_of(r.unit_slot[u]) == Tier::kMemory) memory_bytes_read_ += bytes;
      }
    }
  }
  // The failed units only (the per-layer path records nothing): why, and the slot each lay in.
  for (uint32_t u = 0; u < n; ++u) {
    if (!r.unit_failed[u]) continue;
    out->failed_units.push_back(u);
    UnitFailure f;
    f.unit = u;
    f.key = r.keys[u];
    f.cause = r.unit_cause[u] ? static_cast<UnitFailCause>(r.unit_cause[u]) : UnitFailCause::kIoError;
    if (f.cause == UnitFailCause::kIoError) f.error = r.unit_errno[u];
    if (const uint32_t slot = r.unit_slot[u]; slot != kNoSlot) {
      const PoolPath& p = pool_->path(pool_->path_of(slot));
      f.pool_file = p.file;
      f.slot = slot - p.first_slot;
      f.offset = pool_->offset_of(slot);
    }
    out->failures.push_back(std::move(f));
  }
  release_request(id, r);
  lk.unlock();
  for (uint64_t key : through) flush_now(key);
  return Status::Ok();
}

}  // namespace tutti
