// The host backend: page-aligned mmap memory and a host thread that plays the I/O kernel (the CPU
// stand-in for the GPU kernel on dedicated SMs). It runs the same protocol as the CUDA kernel: post
// IOCTXs as SQEs, wait for their CQEs, verify and scatter (retrieve) or gather and checksum (store).
// Objects in mapped pool files (map_memory) need no I/O: that thread and its helpers move them
// between the mapping and the KV blocks directly, checksumming as they copy. The helpers also
// share the verification of completed reads.
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "backend.h"
#include "tutti/crc32c.h"

namespace tutti {

namespace {

constexpr size_t kMaxIov = 1024;  // IOV_MAX

// Pool files on memory file systems are mapped; a part of one cut off under the store (the file
// truncated by someone else, or a hole punched in a full tmpfs) raises SIGBUS at the first load or
// store there. The copy of a mapped object runs under this guard: the signal ends that copy and
// fails its unit (a miss, as the same cut gives a disk's file through pread); any other SIGBUS
// goes to the disposition that was there before (the default: the process ends with SIGBUS; an
// ignored SIGBUS, which the kernel never ignores for a fault, likewise).
thread_local sigjmp_buf* t_bus_guard = nullptr;
struct sigaction g_prev_bus;

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  if (sigjmp_buf* guard = t_bus_guard) siglongjmp(*guard, 1);
  if (g_prev_bus.sa_flags & SA_SIGINFO) {
    if (g_prev_bus.sa_sigaction) g_prev_bus.sa_sigaction(sig, info, ctx);
  } else if (g_prev_bus.sa_handler == SIG_DFL || g_prev_bus.sa_handler == SIG_IGN) {
    ::signal(SIGBUS, SIG_DFL);
    ::raise(SIGBUS);
  } else {
    g_prev_bus.sa_handler(sig);
  }
}

// Puts the guard first, before each batch of mapped copies: a handler installed after it (Python's
// faulthandler, say) becomes the disposition it hands other SIGBUS to, instead of running first.
void ensure_bus_guard() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  struct sigaction cur {};
  ::sigaction(SIGBUS, nullptr, &cur);
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return;
  g_prev_bus = cur;
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;  // left by siglongjmp: SIGBUS must stay unblocked
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

inline uint64_t make_tag(uint32_t iocb, uint32_t chunk, uint32_t ctx_off) {
  return (static_cast<uint64_t>(iocb) << 32) | (static_cast<uint64_t>(chunk) << 12) | ctx_off;
}

class HostBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  bool host_agent_polls() const override { return false; }

  Status alloc_host(uint64_t bytes, void** ptr) override { return map_host(bytes, ptr); }
  void free_host(void* ptr, uint64_t bytes) override { unmap_host(ptr, bytes); }

  Status start(KernelContext* ctx, uint32_t workers) override {
    (void)workers;  // one SQ/CQ pair and one kernel thread, with helper threads for copies and checksums
    k_ = ctx;
    launch_mem_.resize(ctx->num_iocbs);
    launch_ = SpscRing<uint32_t>(&launch_ctl_, launch_mem_.data(), launch_mem_.size());
    posted_.assign(ctx->num_iocbs, 0);
    done_.assign(ctx->num_iocbs, 0);
    count_.assign(ctx->num_iocbs, 0);
    const Geometry& g = ctx->geom;
    group_ = g.objs_per_layer == 2 && ctx->chunk_bytes == g.obj_bytes && ctx->num_chunks >= 4 ? 2 : 1;
    for (uint32_t c = ctx->num_chunks / group_; c-- > 0;) free_slots_.push_back(c);
    slot_iov_.assign(ctx->num_chunks / group_, {});
    slot_direct_.assign(ctx->num_chunks / group_, 0);
    stop_ = false;
    any_mapped_ = std::any_of(ctx->mapped.begin(), ctx->mapped.end(), [](const uint8_t* m) { return m != nullptr; });
    // Copies and checksums are bound by memory bandwidth: up to eight threads share them.
    const uint32_t threads = std::clamp<uint32_t>(std::thread::hardware_concurrency(), 1, 8);
    for (uint32_t i = 1; i < threads; ++i) helpers_.emplace_back([this] { help(); });
    thread_ = std::thread([this] { run(); });
    return Status::Ok();
  }

  Status scatter_from_host(uint32_t slot, const uint8_t* unit, const uint64_t* dst, const uint64_t* sums,
                           int64_t stream) override {
    // Done here and now: host work is ordered already (the engine thread made the data before
    // calling), so `stream` has nothing to order. One pass per object: copy each block while
    // summing it, as the I/O kernel does.
    (void)stream;
    const Geometry& g = k_->geom;
    const uint64_t payload = g.payload_bytes();
    int64_t& bad = scatter_bad_[slot];
    bad = -1;
    for (uint32_t o = 0; o < g.num_objs(); ++o) {
      const uint8_t* src = unit + g.header_bytes + static_cast<uint64_t>(o) * g.obj_bytes;
      uint32_t sum = 0;
      for (uint32_t b = 0; b < g.unit_blocks; ++b) {
        auto* d = reinterpret_cast<uint8_t*>(dst[static_cast<uint64_t>(o) * g.unit_blocks + b]);
        const uint8_t* s = src + b * g.block_bytes;
        sum = d ? crc32c_copy_stream(sum, d, s, g.block_bytes) : crc32c_extend(sum, s, g.block_bytes);  // 0: skipped
      }
      if (crc32c_extend(sum, src + payload, g.obj_bytes - payload) != sums[o]) {
        bad = o;
        break;
      }
    }
    return Status::Ok();
  }

  Status scatter_wait(uint32_t slot, int64_t* bad) override {
    *bad = scatter_bad_[slot];
    return Status::Ok();
  }

  Status launch(const uint32_t* ids, uint32_t n, uint32_t sms, uint64_t event) override {
    (void)sms;
    (void)event;  // host work is already ordered: the engine thread made the data before calling
    for (uint32_t i = 0; i < n; ++i)
      while (!launch_.push(ids[i])) std::this_thread::yield();
    k_->kernel_bell->notify();
    return Status::Ok();
  }

  void stop() override {
    if (!thread_.joinable()) return;
    stop_ = true;
    k_->kernel_bell->notify();
    thread_.join();
    {
      std::lock_guard<std::mutex> l(job_mu_);
      job_cv_.notify_all();
    }
    for (auto& t : helpers_) t.join();
    helpers_.clear();
  }

  double kernel_cpu_seconds() const override { return has_clock_.load() ? thread_cpu_seconds(clock_) : last_cpu_s_; }
  uint64_t direct_ios() const override { return direct_ios_.load(std::memory_order_relaxed); }
  ~HostBackend() override { stop(); }

 private:
  void run();
  uint32_t group_size(const Iocb& b, const RequestView& r, uint32_t off) const;
  template <typename F>
  void for_each_piece(uint32_t layer, const RequestView& r, const Ioctx& x, F f) const;
  uint64_t move_object(uint32_t layer, const RequestView& r, const Ioctx& x, uint8_t* obj, bool to_blocks);
  uint64_t sum_in_place(uint32_t layer, const RequestView& r, const Ioctx& x, const uint8_t* pad) const;
  bool build_iov(uint32_t layer, const RequestView& r, const Ioctx* xs, uint32_t n, uint8_t* pad, uint32_t align,
                 std::vector<struct iovec>* iov) const;
  bool post(uint32_t id, SpscRing<Sqe>& sq);
  void gather(const Sqe& e);
  void verify(const Cqe& c);
  void retire(const Cqe& c);
  void finish_ctx(uint32_t id);
  // Bytes of the object that sit in KV blocks: all its blocks, fewer for a partial unit (the rest
  // of the object is zeros on store and is only summed on retrieve, like alignment padding).
  uint64_t payload_of(const RequestView& r, const Ioctx& x) const {
    uint64_t blocks = 0;
    for (uint32_t e = 0; e < x.extent_count; ++e) blocks += r.extents[x.extent_first + e].num_blocks;
    return blocks * k_->geom.block_bytes;
  }
  bool mapped(const Ioctx& x) const { return x.slot != kNoSlot && x.path < k_->mapped.size() && k_->mapped[x.path]; }
  // The checksum the commit header carries for object `x` of `layer`.
  uint64_t& object_sum(RequestView& r, uint32_t layer, const Ioctx& x) const {
    const Geometry& g = k_->geom;
    return r.checksums[static_cast<uint64_t>(x.unit) * g.num_objs() + layer * g.objs_per_layer + x.obj];
  }
  // Marks the unit failed (its blocks are reported as not loaded) and counts the IOCB's error; an
  // I/O error (why 1) also records its errno (0: a short transfer) for finish to report; any thread.
  static void fail_unit(RequestView& r, Iocb& b, uint32_t unit, uint8_t why, int32_t err = 0) {
    if (why == 1 && r.unit_errno) __atomic_store_n(&r.unit_errno[unit], err, __ATOMIC_RELAXED);
    __atomic_store_n(&r.unit_failed[unit], why, __ATOMIC_RELAXED);
    __atomic_fetch_add(&b.errors, 1, __ATOMIC_RELAXED);
  }
  void run_mapped(uint32_t id);
  void move_mapped(uint32_t id, uint32_t off);
  void parallel_for(uint32_t n, const std::function<void(uint32_t)>& fn);
  void work();
  void help();

  KernelContext* k_ = nullptr;
  RingCtl launch_ctl_{};
  std::vector<uint32_t> launch_mem_;
  SpscRing<uint32_t> launch_;
  std::vector<uint32_t> posted_, done_;
  // Each IOCB's IOCTX count as launched: once its completion is published the store may give the
  // IOCB back or refill it, so this thread never reads the IOCB's own count after that.
  std::vector<uint32_t> count_;
  uint32_t group_ = 1;                // staging chunks per slot (2: K and V move as one I/O)
  std::vector<uint32_t> free_slots_;  // slots of group_ adjacent staging chunks
  std::vector<std::vector<struct iovec>> slot_iov_;  // scatter-gather list of each slot's I/O
  std::vector<uint8_t> slot_direct_;  // the slot's I/O goes straight to the KV blocks
  std::atomic<uint64_t> direct_ios_{0};
  std::deque<uint32_t> active_;
  std::vector<Sqe> pending_;  // SQEs of one post() call, pushed after the stores' gathers
  std::vector<Cqe> batch_;    // completions verified together
  bool any_mapped_ = false;
  int64_t scatter_bad_[kScatterSlots] = {};  // each slot's verdict, until its scatter_wait
  // One parallel loop at a time (parallel_for), shared by this thread and the helpers.
  std::vector<std::thread> helpers_;
  std::mutex job_mu_;
  std::condition_variable job_cv_, job_done_cv_;
  uint64_t job_gen_ = 0;
  uint32_t job_busy_ = 0, job_n_ = 0;
  const std::function<void(uint32_t)>* job_fn_ = nullptr;
  std::atomic<uint32_t> job_next_{0};
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> has_clock_{false};
  clockid_t clock_{};
  double last_cpu_s_ = 0;
};

void HostBackend::run() {
  SpscRing<Sqe> sq = k_->queues[0].sq_ring();
  SpscRing<Cqe> cq = k_->queues[0].cq_ring();
  if (pthread_getcpuclockid(pthread_self(), &clock_) == 0) has_clock_ = true;
  while (!stop_.load(std::memory_order_relaxed)) {
    bool progress = false;
    // Post as many IOCTXs as staging chunks allow, oldest IOCB first; the walk also finishes the
    // IOCTXs that need no I/O.
    auto post_all = [&] {
      bool posted_any = false;
      for (uint32_t a : active_) posted_any |= post(a, sq);
      if (posted_any) {
        k_->agent->kick();
        progress = true;
      }
    };
    uint32_t id;
    while (launch_.pop(&id)) {
      posted_[id] = done_[id] = 0;
      count_[id] = k_->iocbs[id].ctx_count;
      active_.push_back(id);
      progress = true;
      // Each IOCB's mapped objects move, and are finished, before the next one's: a layer is
      // published as soon as it has moved, not once every layer launched with it has.
      run_mapped(id);
      post_all();
    }
    post_all();
    // Completions: verified in parallel (each reads its own objects), then retired in order.
    Cqe c;
    batch_.clear();
    while (cq.pop(&c)) batch_.push_back(c);
    if (!batch_.empty()) {
      parallel_for(static_cast<uint32_t>(batch_.size()), [this](uint32_t i) { verify(batch_[i]); });
      for (const Cqe& done : batch_) retire(done);
      progress = true;
    }
    while (!active_.empty() && done_[active_.front()] == count_[active_.front()]) active_.pop_front();
    if (progress) continue;
    k_->kernel_bell->wait([&] { return stop_.load() || !cq.empty() || !launch_.empty(); }, 100000);
  }
  last_cpu_s_ = thread_cpu_seconds(clock_);
  has_clock_ = false;
}

// IOCTXs that go in one storage I/O: K and V of one unit and layer are adjacent in the GPU file, so
// when their chunks are adjacent in staging too they move as one I/O of twice the size.
uint32_t HostBackend::group_size(const Iocb& b, const RequestView& r, uint32_t off) const {
  if (group_ < 2 || off + 1 >= b.ctx_count) return 1;
  const Ioctx& x = r.ctx[b.ctx_first + off];
  const Ioctx& y = r.ctx[b.ctx_first + off + 1];
  return x.obj == 0 && y.unit == x.unit && y.obj == 1 ? 2 : 1;
}

// Calls f(block_bytes_ptr, offset_in_object, length) for every run of the object's bytes that sits in
// the KV blocks, in object order; block_bytes_ptr is null for a retrieve's skipped blocks.
template <typename F>
void HostBackend::for_each_piece(uint32_t layer, const RequestView& r, const Ioctx& x, F f) const {
  const Geometry& g = k_->geom;
  const LayerKV& l = k_->extents->layers()[layer];
  for (uint32_t e = 0; e < x.extent_count; ++e) {
    const Extent& ext = r.extents[x.extent_first + e];
    const uint64_t at = static_cast<uint64_t>(ext.unit_offset_blocks) * g.block_bytes;
    if (ext.skip()) {
      f(nullptr, at, ext.num_blocks * g.block_bytes);
    } else if (l.block_stride == g.block_bytes) {
      f(k_->extents->addr(layer, x.obj, ext.first_block), at, ext.num_blocks * g.block_bytes);
    } else {
      for (uint32_t j = 0; j < ext.num_blocks; ++j)
        f(k_->extents->addr(layer, x.obj, ext.first_block + j), at + j * g.block_bytes, g.block_bytes);
    }
  }
}

// Moves one object between staging and its KV blocks (`to_blocks`: retrieve) in one pass that also
// sums the staging-side bytes; returns the object's checksum. Skipped blocks (retrieve) are summed
// only. A retrieve writes the KV blocks with streaming stores: the forward reads a restored layer
// once, not at once, and on the 2-core VM a restore's checked copy of 269 MB from the memory tier
// took 14 ms on two threads streamed against 26 ms with ordinary stores, which first read in every
// line they write (vLLM's TTFT 178 against 185 ms; docs/perf/2026-12-07-memory-tier.md).
uint64_t HostBackend::move_object(uint32_t layer, const RequestView& r, const Ioctx& x, uint8_t* obj, bool to_blocks) {
  const Geometry& g = k_->geom;
  uint32_t crc = 0;
  for_each_piece(layer, r, x, [&](uint8_t* blocks, uint64_t at, uint64_t n) {
    if (!blocks) crc = crc32c_extend(crc, obj + at, n);
    else if (to_blocks) crc = crc32c_copy_stream(crc, blocks, obj + at, n);
    else crc = crc32c_copy(crc, obj + at, blocks, n);
  });
  const uint64_t payload = payload_of(r, x);
  if (payload < g.obj_bytes) {  // padding, or a partial unit's missing blocks: zero on store, checked on retrieve
    if (!to_blocks) std::memset(obj + payload, 0, g.obj_bytes - payload);
    crc = crc32c_extend(crc, obj + payload, g.obj_bytes - payload);
  }
  return crc;
}

// Checksum of an object whose blocks are in place and whose padding is at `pad`.
uint64_t HostBackend::sum_in_place(uint32_t layer, const RequestView& r, const Ioctx& x, const uint8_t* pad) const {
  const Geometry& g = k_->geom;
  uint32_t crc = 0;
  for_each_piece(layer, r, x, [&](uint8_t* blocks, uint64_t, uint64_t n) { crc = crc32c_extend(crc, blocks, n); });
  const uint64_t payload = payload_of(r, x);
  if (payload < g.obj_bytes) crc = crc32c_extend(crc, pad, g.obj_bytes - payload);
  return crc;
}

// Scatter-gather list of `n` adjacent objects straight in the KV blocks, padding in `pad` (the
// slot's staging chunks). False when the list would be too long for one I/O, an object skips
// blocks (their bytes need a place to be summed: staging), or a block's address or length is not a
// multiple of `align` (the O_DIRECT alignment of the file).
bool HostBackend::build_iov(uint32_t layer, const RequestView& r, const Ioctx* xs, uint32_t n, uint8_t* pad,
                            uint32_t align, std::vector<struct iovec>* iov) const {
  const Geometry& g = k_->geom;
  if (g.block_bytes % align != 0) return false;
  iov->clear();
  for (uint32_t k = 0; k < n; ++k) {
    uint64_t next = 0;
    bool ordered = true;
    for_each_piece(layer, r, xs[k], [&](uint8_t* blocks, uint64_t at, uint64_t len) {
      ordered = ordered && at == next && blocks && reinterpret_cast<uintptr_t>(blocks) % align == 0;
      next = at + len;
      iov->push_back({blocks, len});
    });
    const uint64_t payload = payload_of(r, xs[k]);
    if (!ordered || next != payload) return false;
    if (payload < g.obj_bytes) iov->push_back({pad + k * k_->chunk_bytes + payload, g.obj_bytes - payload});
  }
  return iov->size() <= kMaxIov;
}

// Posts the IOCB's next IOCTXs; IOCTXs that need no I/O (a missing unit) complete at once.
bool HostBackend::post(uint32_t id, SpscRing<Sqe>& sq) {
  Iocb& b = k_->iocbs[id];
  RequestView& r = k_->requests[b.request];
  const Geometry& g = k_->geom;
  const auto op = static_cast<IoOp>(b.op);
  // IOCTXs finish in this walk's order (or later, on their CQE): the walk never reads the request
  // again after its last IOCTX finished, when the engine may already be releasing it.
  while (posted_[id] < count_[id]) {
    const uint32_t off = posted_[id];
    const uint32_t idx = b.ctx_first + off;
    const Ioctx& x = r.ctx[idx];
    const uint32_t unit = x.unit;
    const uint32_t n = group_size(b, r, off);
    if (mapped(x)) {  // moved by run_mapped when the IOCB was launched
      posted_[id] += 1;
      finish_ctx(id);
      continue;
    }
    if (x.slot == kNoSlot || r.unit_failed[unit]) {
      posted_[id] += n;
      for (uint32_t k = 0; k < n; ++k) finish_ctx(id);
      continue;
    }
    if (free_slots_.empty() || sq.size() + pending_.size() >= sq.capacity()) break;
    const uint32_t slot = free_slots_.back();
    const uint64_t buf_offset = static_cast<uint64_t>(slot) * group_ * k_->chunk_bytes;
    uint8_t* buf = k_->staging + buf_offset;
    Sqe s{};
    s.tag = make_tag(id, slot, off);
    s.buf_offset = buf_offset;
    s.path = static_cast<uint16_t>(x.path);
    slot_direct_[slot] = 0;
    s.file_offset = x.file_offset + g.obj_offset(b.layer, x.obj);
    s.len = static_cast<uint32_t>(n * g.obj_bytes);
    s.op = static_cast<uint16_t>(op == IoOp::kRead ? IoOp::kRead : IoOp::kWrite);
    // KV blocks that the file takes as they are (any buffer on memory file systems, aligned ones
    // under O_DIRECT): no staging copy, the I/O moves the bytes straight between the file and the
    // blocks, and the checksum is taken in place.
    std::vector<struct iovec>& iov = slot_iov_[slot];
    if (build_iov(b.layer, r, &r.ctx[idx], n, buf, k_->buffer_align[x.path], &iov)) {
      slot_direct_[slot] = 1;
      ++direct_ios_;
      s.op = static_cast<uint16_t>(op == IoOp::kRead ? IoOp::kReadv : IoOp::kWritev);
      s.buf_offset = reinterpret_cast<uint64_t>(iov.data());
      s.len = static_cast<uint32_t>(iov.size());
    }
    pending_.push_back(s);  // stores gather below, in parallel, before any of these is posted
    free_slots_.pop_back();
    posted_[id] += n;
  }
  if (pending_.empty()) return false;
  if (op == IoOp::kWrite)
    parallel_for(static_cast<uint32_t>(pending_.size()), [this](uint32_t i) { gather(pending_[i]); });
  for (const Sqe& e : pending_) sq.push(e);  // room was checked above: the agent only frees more
  pending_.clear();
  return true;
}

// A store's objects for one SQE: gathered from the KV blocks into staging (or, straight I/O, summed
// in place) with the checksums that the commit header will carry. Runs on any thread.
void HostBackend::gather(const Sqe& e) {
  const uint32_t id = static_cast<uint32_t>(e.tag >> 32);
  const uint32_t slot = static_cast<uint32_t>((e.tag >> 12) & 0xfffff);
  const uint32_t off = static_cast<uint32_t>(e.tag & 0xfff);
  const Iocb& b = k_->iocbs[id];
  RequestView& r = k_->requests[b.request];
  const Geometry& g = k_->geom;
  const uint32_t idx = b.ctx_first + off;
  uint8_t* buf = k_->staging + static_cast<uint64_t>(slot) * group_ * k_->chunk_bytes;
  for (uint32_t k = 0, n = group_size(b, r, off); k < n; ++k) {
    const Ioctx& xk = r.ctx[idx + k];
    uint8_t* obj = buf + k * k_->chunk_bytes;
    uint64_t& sum = object_sum(r, b.layer, xk);
    if (slot_direct_[slot]) {
      const uint64_t payload = payload_of(r, xk);
      std::memset(obj + payload, 0, g.obj_bytes - payload);
      sum = sum_in_place(b.layer, r, xk, obj + payload);
    } else {
      sum = move_object(b.layer, r, xk, obj, false);
    }
  }
}

// Checks a completion: its result, and for a read every object's checksum, verified as it moves
// from staging (or in place). A failure marks the unit failed, so its blocks are reported as not
// loaded (a miss) and the engine recomputes them; never presented as a hit. Runs on any thread.
void HostBackend::verify(const Cqe& c) {
  const uint32_t id = static_cast<uint32_t>(c.tag >> 32);
  const uint32_t slot = static_cast<uint32_t>((c.tag >> 12) & 0xfffff);
  const uint32_t off = static_cast<uint32_t>(c.tag & 0xfff);
  Iocb& b = k_->iocbs[id];
  RequestView& r = k_->requests[b.request];
  const Geometry& g = k_->geom;
  const auto op = static_cast<IoOp>(b.op);
  const uint32_t idx = b.ctx_first + off;
  const uint32_t unit = r.ctx[idx].unit;
  const uint32_t n = group_size(b, r, off);
  const uint64_t want = n * g.obj_bytes;
  if (c.res != static_cast<int64_t>(want)) {
    fail_unit(r, b, unit, 1, c.res < 0 ? static_cast<int32_t>(-c.res) : 0);
    return;
  }
  if (op != IoOp::kRead) return;
  uint8_t* buf = k_->staging + static_cast<uint64_t>(slot) * group_ * k_->chunk_bytes;
  for (uint32_t k = 0; k < n; ++k) {
    const Ioctx& xk = r.ctx[idx + k];
    uint8_t* obj = buf + k * k_->chunk_bytes;
    const uint64_t got = slot_direct_[slot] ? sum_in_place(b.layer, r, xk, obj + payload_of(r, xk))
                                            : move_object(b.layer, r, xk, obj, true);
    if (got != object_sum(r, b.layer, xk)) fail_unit(r, b, unit, 2);
  }
}

// Frees a verified completion's staging slot and finishes its IOCTXs (this thread only).
void HostBackend::retire(const Cqe& c) {
  const uint32_t id = static_cast<uint32_t>(c.tag >> 32);
  const uint32_t off = static_cast<uint32_t>(c.tag & 0xfff);
  Iocb& b = k_->iocbs[id];
  free_slots_.push_back(static_cast<uint32_t>((c.tag >> 12) & 0xfffff));
  const uint32_t n = group_size(b, k_->requests[b.request], off);
  for (uint32_t k = 0; k < n; ++k) finish_ctx(id);
}

void HostBackend::finish_ctx(uint32_t id) {
  Iocb& b = k_->iocbs[id];
  if (++done_[id] == count_[id]) {
    __atomic_store_n(&b.done_seq, b.issue_seq, __ATOMIC_RELEASE);
    k_->done_bell->notify();
  }
}

// Moves the objects of IOCB `id` that lie in mapped files, on this thread and the helpers; post()
// then finishes those IOCTXs in its walk.
void HostBackend::run_mapped(uint32_t id) {
  const Iocb& b = k_->iocbs[id];
  if (!any_mapped_) return;
  ensure_bus_guard();
  parallel_for(b.ctx_count, [this, id](uint32_t off) { move_mapped(id, off); });
}

// One IOCTX of a mapped file: retrieve verifies as it copies into the KV blocks (a mismatch fails
// the unit: a miss); store gathers and records the checksum that the commit header will carry.
void HostBackend::move_mapped(uint32_t id, uint32_t off) {
  Iocb& b = k_->iocbs[id];
  RequestView& r = k_->requests[b.request];
  const Ioctx& x = r.ctx[b.ctx_first + off];
  if (!mapped(x) || __atomic_load_n(&r.unit_failed[x.unit], __ATOMIC_RELAXED)) return;
  const Geometry& g = k_->geom;
  const bool read = static_cast<IoOp>(b.op) == IoOp::kRead;
  uint8_t* obj = k_->mapped[x.path] + x.file_offset + g.obj_offset(b.layer, x.obj);
  uint64_t& sum = object_sum(r, b.layer, x);
  sigjmp_buf guard;
  if (sigsetjmp(guard, 0) != 0) {  // the mapping was cut under the copy (install_bus_guard)
    t_bus_guard = nullptr;
    fail_unit(r, b, x.unit, 1, EIO);  // the file's pages could not be read or written
    return;
  }
  t_bus_guard = &guard;
  const uint64_t got = move_object(b.layer, r, x, obj, read);
  t_bus_guard = nullptr;
  if (!read) {
    sum = got;
  } else if (got != sum) {
    fail_unit(r, b, x.unit, 2);
  }
}

// Runs fn(0..n-1) on this thread and the helpers; returns when every call has returned.
void HostBackend::parallel_for(uint32_t n, const std::function<void(uint32_t)>& fn) {
  if (helpers_.empty() || n < 2) {
    for (uint32_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> l(job_mu_);
    job_fn_ = &fn;
    job_n_ = n;
    job_next_.store(0);
    job_busy_ = static_cast<uint32_t>(helpers_.size());
    ++job_gen_;
  }
  job_cv_.notify_all();
  work();
  std::unique_lock<std::mutex> l(job_mu_);
  job_done_cv_.wait(l, [&] { return job_busy_ == 0; });
}

void HostBackend::work() {
  for (uint32_t i; (i = job_next_.fetch_add(1)) < job_n_;) (*job_fn_)(i);
}

void HostBackend::help() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> l(job_mu_);
      job_cv_.wait(l, [&] { return stop_.load() || job_gen_ != seen; });
      if (stop_.load()) return;
      seen = job_gen_;
    }
    work();
    std::lock_guard<std::mutex> l(job_mu_);
    if (--job_busy_ == 0) job_done_cv_.notify_one();
  }
}

}  // namespace

std::unique_ptr<Backend> make_host_backend() { return std::make_unique<HostBackend>(); }

}  // namespace tutti
