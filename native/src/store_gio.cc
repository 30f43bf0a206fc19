// The engine session's IOCB table and the raw gio_uring API (store.h): get_iocb, fill_iocb,
// issue_io, wait_cqe and put_iocb, and the issue and completion of IOCBs that requests share.
#include "tutti/store.h"

#include <algorithm>

#include "backend.h"
#include "gio_queue.h"

namespace tutti {

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
  for (int us = 20; !done(); us = std::min(2 * us, longest)) done_bell_->wait(done, us);
}

Status Store::wait_cqe(uint32_t id, uint64_t* errors) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  if (id >= num_iocbs_) return {Code::kInvalid, "no IOCB " + std::to_string(id) + " (the table holds " + std::to_string(num_iocbs_) + ")"};
  wait_done(id);
  if (errors) *errors = iocbs_[id].errors;
  return Status::Ok();
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

}  // namespace tutti
