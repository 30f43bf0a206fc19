#include "tutti/store.h"

#include <algorithm>
#include <cstring>

namespace tutti {

namespace {

constexpr uint32_t kNoSlot = UINT32_MAX;

}  // namespace

Status Store::open(const StoreOptions& opt, const std::vector<LayerKV>& layers, const std::string& desc,
                   std::unique_ptr<Store>* out) {
  if (opt.read_only) return {Code::kInvalid, "an engine session writes: open a UnitStore to read pools only"};
  std::unique_ptr<Store> s(new Store());
  Geometry g;
  Status st = make_geometry(layers, opt.unit_blocks, desc, &g);
  if (!st.ok()) return st;
  st = s->extents_.init(layers);
  if (!st.ok()) return st;
  st = s->open_units(opt, g, desc);
  if (!st.ok()) return st;
  *out = std::move(s);
  return Status::Ok();
}

Status Store::init_queue(uint32_t depth) {
  if (started_) return {Code::kInvalid, "queues already initialised"};
  if (depth == 0) return {Code::kConfig, "queue depth must be positive"};
  const Geometry& g = geom_;
  if (opt_.backend == "cpu") {
    backend_ = make_host_backend();
  } else if (opt_.backend == "cuda") {
#ifdef TUTTI_WITH_CUDA
    Status st;
    backend_ = make_cuda_backend(opt_.device, opt_.cuda_pair, opt_.cuda_trace, &st);
    if (!st.ok()) return st;
#else
    return {Code::kDevice, "backend 'cuda' requested but this build has no CUDA support"};
#endif
  } else {
    return {Code::kConfig, "unknown backend '" + opt_.backend + "'"};
  }
  const uint64_t chunk = std::max(g.obj_bytes, g.header_bytes);
  uint32_t chunks = static_cast<uint32_t>(opt_.staging_bytes / chunk);
  if (chunks < 2)
    return {Code::kConfig, "staging_bytes (" + std::to_string(opt_.staging_bytes) + ") must hold at least two objects of " +
                               std::to_string(chunk) + " bytes"};
  const uint32_t workers = std::max<uint32_t>(1, backend_->num_workers(std::max<uint32_t>(1, opt_.io_workers), opt_.io_sms));
  const uint32_t nq = backend_->num_queues(workers);
  if (chunks < nq)
    return {Code::kConfig, "staging_bytes (" + std::to_string(opt_.staging_bytes) + ") must hold at least " +
                               std::to_string(nq) + " objects of " + std::to_string(chunk) + " bytes (one per I/O queue)"};
  chunks -= chunks % nq;
  staging_bytes_ = static_cast<uint64_t>(chunks) * chunk;
  Status st = backend_->alloc_host(staging_bytes_, &staging_);
  if (!st.ok()) return st;
  // One SQ/CQ pair per queue, each deep enough for all of that queue's chunks.
  const uint64_t ring_depth = chunks / nq + 1;
  const uint64_t per_q = 2 * sizeof(RingCtl) + ring_depth * (sizeof(Sqe) + sizeof(Cqe));
  queue_bytes_ = align_up(per_q * nq);
  st = backend_->alloc_host(queue_bytes_, &queue_mem_);
  if (!st.ok()) return st;
  std::memset(queue_mem_, 0, queue_bytes_);
  std::vector<QueuePair> qs;
  uint8_t* p = static_cast<uint8_t*>(queue_mem_);
  for (uint32_t w = 0; w < nq; ++w) {
    QueuePair q;
    q.depth = ring_depth;
    q.sq_ctl = reinterpret_cast<RingCtl*>(p);
    q.cq_ctl = reinterpret_cast<RingCtl*>(p + sizeof(RingCtl));
    q.sq = reinterpret_cast<Sqe*>(p + 2 * sizeof(RingCtl));
    q.cq = reinterpret_cast<Cqe*>(p + 2 * sizeof(RingCtl) + ring_depth * sizeof(Sqe));
    qs.push_back(q);
    p += per_q;
  }
  iocb_bytes_ = align_up(static_cast<uint64_t>(depth) * sizeof(Iocb));
  void* iocb_mem = nullptr;
  st = backend_->alloc_host(iocb_bytes_, &iocb_mem);
  if (!st.ok()) return st;
  std::memset(iocb_mem, 0, iocb_bytes_);
  iocbs_ = static_cast<Iocb*>(iocb_mem);
  num_iocbs_ = depth;
  for (uint32_t i = depth; i-- > 0;) free_iocbs_.push_back(i);
  iocb_owner_.assign(depth, kFree);
  raw_issue_.assign(depth, RawIssue{});
  requests_.assign(opt_.max_requests, Request{});
  views_.assign(opt_.max_requests, RequestView{});

  Agent::Options ao;
  ao.depth = opt_.queue_depth;
  for (uint32_t i = 0; i < pool_.num_paths(); ++i) {
    ao.fds.push_back(pool_.path(i).fd);
    // Memory-backed file systems complete every request inline, O_DIRECT or not (tmpfs accepts
    // O_DIRECT since Linux 6.6): punt those to io_uring's workers so that copies run in parallel.
    ao.punt.push_back(pool_.path(i).cached() ? 1 : 0);
  }
  ao.staging = staging_;
  ao.staging_bytes = staging_bytes_;
  ao.poll_rings = backend_->host_agent_polls();
  st = agent_.start(ao, qs, &kernel_bell_);
  if (!st.ok()) return st;

  kctx_.geom = g;
  kctx_.extents = &extents_;
  kctx_.iocbs = iocbs_;
  kctx_.num_iocbs = depth;
  kctx_.requests = views_.data();
  kctx_.max_requests = opt_.max_requests;
  kctx_.staging = static_cast<uint8_t*>(staging_);
  kctx_.chunk_bytes = chunk;
  kctx_.num_chunks = chunks;
  kctx_.queues = qs;
  kctx_.queue_depth = opt_.queue_depth;
  if (opt_.map_memory) {
    st = pool_.map_memory_files();
    if (!st.ok()) return st;
  }
  kctx_.buffer_align.clear();
  kctx_.mapped.clear();
  kctx_.mapped_bytes.clear();
  for (uint32_t i = 0; i < pool_.num_paths(); ++i) {
    kctx_.buffer_align.push_back(pool_.path(i).buffer_align);
    kctx_.mapped.push_back(pool_.path(i).map);
    kctx_.mapped_bytes.push_back(pool_.path(i).map_bytes);
  }
  kctx_.agent = &agent_;
  kctx_.kernel_bell = &kernel_bell_;
  kctx_.done_bell = &done_bell_;
  st = backend_->start(&kctx_, workers);
  if (!st.ok()) return st;
  started_ = true;
  return Status::Ok();
}

Store::~Store() { close(); }

void Store::close() {
  if (started_) {
    for (uint32_t i = 0; i < requests_.size(); ++i)
      if (requests_[i].active) {
        RequestResult r;
        finish(i, &r);
      }
    for (uint64_t t : scatter_ticket_)  // scatters not waited for: their blocks are the caller's loss
      if (t) scatter_wait(t);
    backend_->stop();
    agent_.stop();
    backend_->free_host(staging_, staging_bytes_);
    backend_->free_host(queue_mem_, queue_bytes_);
    backend_->free_host(iocbs_, iocb_bytes_);
    iocbs_ = nullptr;
    num_iocbs_ = 0;
    started_ = false;
  }
  UnitStore::close();
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
  r.unit_blocks.assign(n_units, g.unit_blocks);
  if (n_units) r.unit_blocks.back() = static_cast<uint32_t>(n_blocks - whole);
  if (n_inner && op == ReqOp::kStore) {
    r.inner.resize(n_units);
    for (uint32_t u = 0, at = 0; u < n_units; at += n_inner[u++]) r.inner[u].assign(inner + at, inner + at + n_inner[u]);
  }
  std::vector<std::pair<uint32_t, uint32_t>> unit_ext(n_units);
  for (uint32_t u = 0; u < n_units; ++u) {
    uint32_t first = static_cast<uint32_t>(r.extents.size());
    Status st = extents_.build(block_ids + static_cast<uint64_t>(u) * g.unit_blocks, r.unit_blocks[u], &r.extents,
                               op == ReqOp::kRetrieve);
    if (!st.ok()) return st;
    unit_ext[u] = {first, static_cast<uint32_t>(r.extents.size()) - first};
  }
  if (op == ReqOp::kRetrieve) {
    Status st = extents_.check_distinct(r.extents);
    if (!st.ok()) return st;
  }
  for (uint32_t u = 0; u < n_units; ++u) {
    if (op == ReqOp::kRetrieve) {
      uint32_t held = 0;
      if (index_.acquire(keys[u], &r.unit_slot[u], &held) && held >= r.unit_blocks[u]) {
        r.unit_present[u] = 1;
      } else {
        // Evicted since lookup, or a partial unit asked for more blocks than it holds: a miss.
        if (held) index_.unpin(keys[u]);
        r.unit_slot[u] = kNoSlot;
        r.unit_failed[u] = 1;
      }
    } else {
      bool dup = index_.contains(keys[u]) || std::find(keys, keys + u, keys[u]) != keys + u;
      if (dup) {
        r.skipped++;
        continue;
      }
      Status st = alloc_slot(&r.unit_slot[u]);
      if (!st.ok()) {
        if (st.code() != Code::kCapacityExceeded) {
          release_request(id, r);
          return st;
        }
        r.unit_failed[u] = 1;
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
        x.path = pool_.path_of(slot);
        x.file_offset = pool_.offset_of(slot);
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
  *request = id;
  return Status::Ok();
}

Status Store::take_iocbs(uint32_t n, uint32_t owner, std::vector<uint32_t>* ids) {
  if (free_iocbs_.size() < n)
    return {Code::kCapacityExceeded, "IOCB table exhausted: " + std::to_string(n) + " wanted, " +
                                         std::to_string(free_iocbs_.size()) + " free (init_queue depth " +
                                         std::to_string(num_iocbs_) + ")"};
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t id = free_iocbs_.back();
    free_iocbs_.pop_back();
    Iocb& b = iocbs_[id];
    b.in_use = 1;
    b.ctx_count = 0;
    iocb_owner_[id] = owner;
    ids->push_back(id);
  }
  return Status::Ok();
}

void Store::give_back_iocb(uint32_t id) {
  iocbs_[id].in_use = 0;
  iocbs_[id].ctx_count = 0;
  iocb_owner_[id] = kFree;
  free_iocbs_.push_back(id);
}

bool Store::in_flight(uint32_t id) const {
  const Iocb& b = iocbs_[id];
  return __atomic_load_n(&b.done_seq, __ATOMIC_ACQUIRE) != b.issue_seq;
}

Status Store::get_iocb(uint32_t n, std::vector<uint32_t>* ids) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  std::lock_guard<std::mutex> lk(mu_);
  return take_iocbs(n, kRawOwner, ids);
}

Status Store::fill_iocb(uint32_t id, IoOp op, uint32_t layer, uint32_t request, uint32_t first, uint32_t count) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  std::lock_guard<std::mutex> lk(mu_);
  if (id >= num_iocbs_ || iocb_owner_[id] != kRawOwner)
    return {Code::kInvalid, "IOCB " + std::to_string(id) + " was not taken with get_iocb"};
  if (in_flight(id)) return {Code::kInvalid, "IOCB " + std::to_string(id) + " is in flight: wait_cqe first"};
  if (op != IoOp::kRead && op != IoOp::kWrite) return {Code::kInvalid, "an IOCB's op is read or write"};
  if (layer >= geom_.num_layers)
    return {Code::kLayout, "layer " + std::to_string(layer) + " out of range [0, " + std::to_string(geom_.num_layers) + ")"};
  if (!open_request(request)) return {Code::kInvalid, "no request " + std::to_string(request) + " in flight"};
  Request& r = requests_[request];
  if ((op == IoOp::kRead) != (r.op == ReqOp::kRetrieve))
    return {Code::kInvalid, std::string("request ") + std::to_string(request) + " is a " +
                                (r.op == ReqOp::kRetrieve ? "retrieve" : "store") + " request"};
  if (count == 0 || count > kMaxIoctxPerIocb) return {Code::kInvalid, "an IOCB holds 1 to 2048 IOCTXs"};
  if (static_cast<uint64_t>(first) + count > r.ctx.size())
    return {Code::kInvalid, "IOCTXs [" + std::to_string(first) + ", " + std::to_string(uint64_t(first) + count) +
                                ") exceed the request's " + std::to_string(r.ctx.size())};
  settle_raw(id);
  Iocb& b = iocbs_[id];
  if (b.ctx_count && b.request != request && b.request < requests_.size()) {  // refilled for another request
    auto& before = requests_[b.request].raw_iocbs;
    before.erase(std::remove(before.begin(), before.end(), id), before.end());
  }
  b.op = static_cast<uint32_t>(op);
  b.layer = layer;
  b.request = request;
  b.ctx_first = first;
  b.ctx_count = count;
  if (std::find(r.raw_iocbs.begin(), r.raw_iocbs.end(), id) == r.raw_iocbs.end()) r.raw_iocbs.push_back(id);
  return Status::Ok();
}

Status Store::put_iocb(uint32_t id) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  std::lock_guard<std::mutex> lk(mu_);
  if (id >= num_iocbs_ || iocb_owner_[id] != kRawOwner)
    return {Code::kInvalid, "IOCB " + std::to_string(id) + " was not taken with get_iocb (or was put back already)"};
  if (in_flight(id)) return {Code::kInvalid, "IOCB " + std::to_string(id) + " is in flight: wait_cqe first"};
  settle_raw(id);
  const Iocb& b = iocbs_[id];
  if (b.ctx_count && b.request < requests_.size()) {
    auto& raw = requests_[b.request].raw_iocbs;
    raw.erase(std::remove(raw.begin(), raw.end(), id), raw.end());
  }
  give_back_iocb(id);
  return Status::Ok();
}

Status Store::issue_io(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  std::lock_guard<std::mutex> lk(mu_);
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t id = ids[i];
    if (id >= num_iocbs_ || iocb_owner_[id] != kRawOwner)
      return {Code::kInvalid, "IOCB " + std::to_string(id) + " was not taken with get_iocb"};
    const Iocb& b = iocbs_[id];
    if (b.ctx_count == 0 || !open_request(b.request))
      return {Code::kInvalid, "IOCB " + std::to_string(id) + " is not filled (or its request is finishing or finished)"};
    if (in_flight(id)) return {Code::kInvalid, "IOCB " + std::to_string(id) + " is already in flight"};
    if (std::find(ids, ids + i, id) != ids + i) return {Code::kInvalid, "IOCB " + std::to_string(id) + " given twice"};
  }
  for (uint32_t i = 0; i < n; ++i) {
    settle_raw(ids[i]);  // its previous issue is done (checked above)
    const Iocb& b = iocbs_[ids[i]];
    raw_issue_[ids[i]] = RawIssue{b.request, b.layer, b.ctx_first, b.ctx_count, b.issue_seq + 1};
  }
  return issue_locked(ids, n, sms, event);
}

// Issues IOCBs whose fields were checked (or set by the store itself); under mu_.
Status Store::issue_locked(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event) {
  for (uint32_t i = 0; i < n; ++i) {
    Iocb& b = iocbs_[ids[i]];
    b.errors = 0;
    b.issue_seq++;
  }
  Status st = backend_->launch(ids, n, sms ? sms : opt_.io_sms, event);
  if (!st.ok())  // nothing runs them: mark them done so that nobody waits forever
    for (uint32_t i = 0; i < n; ++i) {
      Iocb& b = iocbs_[ids[i]];
      b.errors = b.ctx_count;
      __atomic_store_n(&b.done_seq, b.issue_seq, __ATOMIC_RELEASE);
    }
  return st;
}

void Store::wait_done(uint32_t id) {
  Iocb& b = iocbs_[id];
  auto done = [&] { return __atomic_load_n(&b.done_seq, __ATOMIC_ACQUIRE) == b.issue_seq; };
  for (int spin = 0; spin < 2000 && !done(); ++spin) __builtin_ia32_pause();
  // The host backend rings done_bell_ (the timeout only guards a lost wake-up); a GPU kernel
  // publishes done_seq in mapped memory and rings nothing, so there sleeps stay short: at most
  // 200 us late.
  const int longest = backend_->host_agent_polls() ? 200 : 10000;
  for (int us = 20; !done(); us = std::min(2 * us, longest)) done_bell_.wait(done, us);
}

Status Store::wait_cqe(uint32_t id, uint64_t* errors) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  if (id >= num_iocbs_) return {Code::kInvalid, "no IOCB " + std::to_string(id) + " (the table holds " + std::to_string(num_iocbs_) + ")"};
  wait_done(id);
  if (errors) *errors = iocbs_[id].errors;
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
      if (r.unit_present[u]) index_.unpin(r.keys[u]);
  } else {
    for (uint32_t u = 0; u < r.keys.size(); ++u)
      if (r.unit_present[u] && r.unit_slot[u] != kNoSlot) pool_.release(r.unit_slot[u]);
  }
  views_[id] = RequestView{};
  r = Request{};
}

void Store::settle_raw(uint32_t id) {
  RawIssue& x = raw_issue_[id];
  if (x.request == UINT32_MAX) return;
  const Iocb& b = iocbs_[id];
  if (__atomic_load_n(&b.done_seq, __ATOMIC_ACQUIRE) != x.seq) return;  // still in flight
  Request& r = requests_[x.request];
  // An issue that could not start or saw an error covers nothing: its units stay unvouched for.
  if (r.active && __atomic_load_n(&b.errors, __ATOMIC_ACQUIRE) == 0) r.raw_done[x.layer].push_back({x.first, x.count});
  x.request = UINT32_MAX;
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
  std::lock_guard<std::mutex> lk(mu_);
  Request& r = requests_[id];
  for (uint32_t b : r.raw_iocbs) settle_raw(b);
  const Geometry& g = geom_;
  const uint32_t n = static_cast<uint32_t>(r.keys.size());
  out->units = n;
  out->skipped_units = r.skipped;
  out->failed_units.clear();
  out->committed_units.clear();
  out->incomplete_layers.clear();
  for (uint32_t l = 0; l < g.num_layers; ++l)
    if (!layer_complete(r, l)) out->incomplete_layers.push_back(l);
  // A unit the kernel could not vouch for (device failure, layers missing) failed, but is not damaged.
  std::vector<uint8_t> not_moved(n, 0);
  Status est = backend_->end_request(id, &views_[id]);
  if (!est.ok() || !out->incomplete_layers.empty())
    for (uint32_t u = 0; u < n; ++u) not_moved[u] = r.unit_present[u];
  for (uint32_t u = 0; u < n; ++u) {
    if (r.unit_failed[u] == 2) checksum_failures_++;
    else if (r.unit_failed[u] == 1 && r.unit_slot[u] != kNoSlot) io_errors_++;
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
      if (r.unit_failed[u] || index_.contains(r.keys[u])) {
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
        io_errors_++;
        invalidate(r.unit_slot[u]);
        continue;  // released below
      }
      r.unit_present[u] = 0;  // now owned by the index
      out->committed_units.push_back(u);
    }
  } else if (r.op == ReqOp::kRetrieve) {
    for (uint32_t u = 0; u < n; ++u) {
      if (!r.unit_present[u]) continue;
      if (r.unit_failed[u]) {
        // Drop the damaged unit: unpin, remove, invalidate, free; unless the key has moved to
        // another slot since (removed and stored again: that entry is not this damage).
        index_.unpin(r.keys[u]);
        r.unit_present[u] = 0;
        uint32_t slot;
        if (index_.remove(r.keys[u], &slot, r.unit_slot[u])) {
          free_slot(slot);
          evicted_.push_back(r.keys[u]);
          inner_of_.erase(r.keys[u]);
        }
      } else if (not_moved[u]) {
        r.unit_failed[u] = 3;  // a miss; the unit stays (unpinned below)
      } else {
        bytes_read_ += static_cast<uint64_t>(r.unit_blocks[u]) * g.block_bytes * g.num_objs();
      }
    }
  }
  for (uint32_t u = 0; u < n; ++u)
    if (r.unit_failed[u]) out->failed_units.push_back(u);
  release_request(id, r);
  return Status::Ok();
}

Status Store::scatter_unit(const uint8_t* data, uint64_t n, const int64_t* block_ids, uint64_t n_blocks) {
  uint64_t ticket = 0;
  Status st = scatter_unit_async(data, n, block_ids, n_blocks, -1, &ticket);
  return st.ok() ? scatter_wait(ticket) : st;
}

Status Store::take_scatter_slot(uint32_t* slot, uint64_t* ticket) {
  std::lock_guard<std::mutex> lk(scatter_mu_);
  for (uint32_t i = 0; i < kScatterSlots; ++i)
    if (!scatter_ticket_[i]) {
      scatter_ticket_[i] = *ticket = next_ticket_++;
      scatter_waited_[i] = false;
      *slot = i;
      return Status::Ok();
    }
  return {Code::kCapacityExceeded,
          std::to_string(kScatterSlots) + " scatters in flight: wait for one (scatter_wait) first"};
}

void Store::free_scatter_slot(uint32_t slot) {
  std::lock_guard<std::mutex> lk(scatter_mu_);
  scatter_ticket_[slot] = 0;
  scatter_waited_[slot] = false;
}

Status Store::scatter_unit_async(const uint8_t* data, uint64_t n, const int64_t* block_ids, uint64_t n_blocks,
                                 int64_t stream, uint64_t* ticket, const uint64_t* want_key) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  const Geometry& g = geom_;
  if (n_blocks != g.unit_blocks) return {Code::kLayout, "scatter_unit needs exactly one unit of block ids"};
  uint64_t key;
  uint32_t blocks;
  std::vector<uint64_t> sums;
  Status st = decode_unit(data, n, &key, &blocks, &sums);
  if (!st.ok()) return st;
  if (want_key && key != *want_key)
    return {Code::kNotFound, "the unit holds key " + std::to_string(key) + ", not " + std::to_string(*want_key)};
  if (blocks != g.unit_blocks)
    return {Code::kLayout, "scatter_unit moves whole units; this one holds " + std::to_string(blocks) + " of " +
                               std::to_string(g.unit_blocks) + " blocks (a prefix's partial tail)"};
  std::vector<Extent> ext;
  st = extents_.build(block_ids, g.unit_blocks, &ext, true);
  if (st.ok()) st = extents_.check_distinct(ext);
  if (!st.ok()) return st;
  std::vector<uint64_t> dst(static_cast<uint64_t>(g.num_objs()) * g.unit_blocks);  // 0: a skipped block
  for (uint32_t l = 0; l < g.num_layers; ++l)
    for (uint32_t o = 0; o < g.objs_per_layer; ++o) {
      uint64_t* d = dst.data() + (static_cast<uint64_t>(l) * g.objs_per_layer + o) * g.unit_blocks;
      for (const Extent& e : ext)
        for (uint32_t j = 0; j < e.num_blocks && !e.skip(); ++j)
          d[e.unit_offset_blocks + j] = reinterpret_cast<uint64_t>(extents_.addr(l, o, e.first_block + j));
    }
  uint32_t slot = 0;
  if (!(st = take_scatter_slot(&slot, ticket)).ok()) return st;
  st = backend_->scatter_from_host(slot, data, dst.data(), sums.data(), stream);
  if (!st.ok()) free_scatter_slot(slot);  // nothing of it is left in flight to wait for
  return st;
}

Status Store::scatter_wait(uint64_t ticket) {
  uint32_t slot = kScatterSlots;
  {
    std::lock_guard<std::mutex> lk(scatter_mu_);
    for (uint32_t i = 0; i < kScatterSlots; ++i)
      if (ticket && scatter_ticket_[i] == ticket && !scatter_waited_[i]) slot = i;
    if (slot == kScatterSlots) return {Code::kInvalid, "no scatter " + std::to_string(ticket) + " in flight"};
    scatter_waited_[slot] = true;
  }
  int64_t bad = -1;
  Status st = backend_->scatter_wait(slot, &bad);
  free_scatter_slot(slot);
  if (!st.ok()) return st;
  if (bad >= 0) {
    std::lock_guard<std::mutex> lk(mu_);
    checksum_failures_++;
    return {Code::kNotFound, "unit object " + std::to_string(bad) + " fails its checksum: its blocks hold no valid KV"};
  }
  return Status::Ok();
}

Status Store::register_host(void* p, uint64_t n) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  if (!p || n == 0) return {Code::kInvalid, "register_host needs a non-empty buffer"};
  return backend_->register_host(p, n);
}

void Store::unregister_host(void* p) {
  if (started_) backend_->unregister_host(p);
}

StoreStats Store::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  StoreStats s = units_stats();
  s.agent_ops = agent_.ops();
  s.agent_cpu_s = agent_.cpu_seconds();
  s.kernel_cpu_s = backend_ ? backend_->kernel_cpu_seconds() : 0;
  s.direct_ios = backend_ ? backend_->direct_ios() : 0;
  s.extent_map_bytes = extents_.memory_bytes() + request_map_peak_;
  s.request_map_peak_bytes = request_map_peak_;
  s.staging_bytes = staging_bytes_;
  s.fixed_buffers = agent_.fixed_buffers();
  for (const uint8_t* m : kctx_.mapped) s.mapped_files += m ? 1 : 0;
  s.backend = backend_ ? backend_->name() : "none";
  return s;
}

}  // namespace tutti
