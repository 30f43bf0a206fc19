// The host agent: drains the SQs into io_uring and returns completions on the CQs.
#include <liburing.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>

#include "agent.h"

namespace tutti {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_us) {
  struct timespec ts{timeout_us / 1000000, (timeout_us % 1000000) * 1000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, timeout_us >= 0 ? &ts : nullptr,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

namespace {
constexpr uint64_t kEventTag = ~0ull;
constexpr uint64_t kFixedPiece = 512ull << 20;  // registered-buffer piece (a multiple of every I/O size)
struct Inflight {
  uint32_t queue;
  uint64_t tag;
};
}  // namespace

Agent::~Agent() { stop(); }

Status Agent::start(const Options& opt, std::vector<QueuePair> queues, Doorbell* consumer_bell) {
  opt_ = opt;
  queues_ = std::move(queues);
  consumer_bell_ = consumer_bell;
  auto* ring = new io_uring;
  int rc = io_uring_queue_init(opt.depth + 1, ring, 0);
  if (rc < 0) {
    delete ring;
    return {Code::kStorage, errno_message("io_uring_queue_init", -rc)};
  }
  ring_ = ring;
  rc = io_uring_register_files(ring, opt.fds.data(), static_cast<unsigned>(opt.fds.size()));
  if (rc < 0) return {Code::kStorage, errno_message("io_uring_register_files", -rc)};
  // Registered buffers save a page walk per I/O; some kernels refuse them for large or device-backed
  // memory, and plain reads still work then.
  // io_uring takes at most 1 GiB per registered buffer: register the staging area in pieces.
  std::vector<struct iovec> iov;
  for (uint64_t at = 0; at < opt.staging_bytes; at += kFixedPiece)
    iov.push_back({static_cast<uint8_t*>(opt.staging) + at, std::min(kFixedPiece, opt.staging_bytes - at)});
  fixed_bufs_ = io_uring_register_buffers(ring, iov.data(), static_cast<unsigned>(iov.size())) == 0;
  efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd_ < 0) return {Code::kStorage, errno_message("eventfd", errno)};
  stop_ = false;
  thread_ = std::thread([this] { run(); });
  return Status::Ok();
}

void Agent::kick() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst) && efd_ >= 0) eventfd_write(efd_, 1);
}

void Agent::stop() {
  if (thread_.joinable()) {
    stop_ = true;
    eventfd_write(efd_, 1);
    thread_.join();
  }
  if (ring_) {
    io_uring_queue_exit(static_cast<io_uring*>(ring_));
    delete static_cast<io_uring*>(ring_);
    ring_ = nullptr;
  }
  if (efd_ >= 0) ::close(efd_);
  efd_ = -1;
}

double thread_cpu_seconds(clockid_t clock) {
  struct timespec ts;
  if (clock_gettime(clock, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double Agent::cpu_seconds() const {
  // Reading another thread's CPU clock is one syscall: done on demand, never in the agent's loop.
  return has_clock_.load() ? thread_cpu_seconds(clock_) : last_cpu_s_;
}

void Agent::run() {
  auto* ring = static_cast<io_uring*>(ring_);
  std::vector<Inflight> slots(opt_.depth);
  std::vector<uint32_t> free_slots;
  for (uint32_t i = opt_.depth; i-- > 0;) free_slots.push_back(i);
  std::vector<SpscRing<Sqe>> sqs;
  std::vector<SpscRing<Cqe>> cqs;
  for (const QueuePair& q : queues_) {
    sqs.push_back(q.sq_ring());
    cqs.push_back(q.cq_ring());
  }
  auto arm_event = [&] {
    io_uring_sqe* e = io_uring_get_sqe(ring);
    io_uring_prep_poll_multishot(e, efd_, POLLIN);
    io_uring_sqe_set_data64(e, kEventTag);
  };
  arm_event();
  io_uring_submit(ring);
  if (pthread_getcpuclockid(pthread_self(), &clock_) == 0) has_clock_ = true;
  uint32_t rr = 0;
  uint64_t idle_spins = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    bool progress = false;
    unsigned prepared = 0;
    for (size_t n = 0; n < sqs.size(); ++n) {
      uint32_t qi = (rr + n) % sqs.size();
      Sqe s;
      while (!free_slots.empty() && io_uring_sq_space_left(ring) > 1 && sqs[qi].pop(&s)) {
        uint32_t slot = free_slots.back();
        free_slots.pop_back();
        slots[slot] = Inflight{qi, s.tag};
        io_uring_sqe* e = io_uring_get_sqe(ring);
        uint8_t* buf = static_cast<uint8_t*>(opt_.staging) + s.buf_offset;
        const bool rd = s.op == static_cast<uint16_t>(IoOp::kRead);
        const uint64_t piece = s.buf_offset / kFixedPiece;
        if (s.op == static_cast<uint16_t>(IoOp::kReadv) || s.op == static_cast<uint16_t>(IoOp::kWritev)) {
          const auto* iov = reinterpret_cast<const struct iovec*>(s.buf_offset);
          if (s.op == static_cast<uint16_t>(IoOp::kReadv)) io_uring_prep_readv(e, s.path, iov, s.len, s.file_offset);
          else io_uring_prep_writev(e, s.path, iov, s.len, s.file_offset);
        } else if (fixed_bufs_ && (s.buf_offset + s.len - 1) / kFixedPiece == piece) {
          if (rd) io_uring_prep_read_fixed(e, s.path, buf, s.len, s.file_offset, static_cast<int>(piece));
          else io_uring_prep_write_fixed(e, s.path, buf, s.len, s.file_offset, static_cast<int>(piece));
        } else {
          if (rd) io_uring_prep_read(e, s.path, buf, s.len, s.file_offset);
          else io_uring_prep_write(e, s.path, buf, s.len, s.file_offset);
        }
        e->flags |= IOSQE_FIXED_FILE;
        if (s.path < opt_.punt.size() && opt_.punt[s.path]) e->flags |= IOSQE_ASYNC;
        io_uring_sqe_set_data64(e, slot);
        ++prepared;
      }
    }
    rr++;
    if (prepared) {
      io_uring_submit(ring);
      ops_.fetch_add(prepared, std::memory_order_relaxed);
      progress = true;
    }
    io_uring_cqe* c;
    bool pushed = false;
    while (io_uring_peek_cqe(ring, &c) == 0) {
      uint64_t ud = io_uring_cqe_get_data64(c);
      if (ud == kEventTag) {
        eventfd_t v;
        eventfd_read(efd_, &v);
        bool more = c->flags & IORING_CQE_F_MORE;
        io_uring_cqe_seen(ring, c);
        if (!more) {
          arm_event();
          io_uring_submit(ring);
        }
        continue;
      }
      const Inflight f = slots[ud];
      Cqe out{f.tag, c->res};
      io_uring_cqe_seen(ring, c);
      free_slots.push_back(static_cast<uint32_t>(ud));
      // CQs hold at least as many entries as the kernel has staging chunks, so this never spins long.
      while (!cqs[f.queue].push(out)) std::this_thread::yield();
      pushed = true;
    }
    if (pushed) {
      consumer_bell_->notify();
      progress = true;
    }
    if (progress) {
      idle_spins = 0;
      continue;
    }
    if (opt_.poll_rings && ++idle_spins < 20000) {
      // The producer is a GPU kernel, which cannot write an eventfd: poll its rings.
      __builtin_ia32_pause();
      continue;
    }
    sleeping_.store(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    // Queued SQEs are work only while a request slot is free: with every slot in flight the agent
    // waits for a completion (checking the SQs then would spin).
    bool work = stop_.load();
    if (!free_slots.empty())
      for (auto& q : sqs) work = work || !q.empty();
    if (!work) {
      if (opt_.poll_rings) {
        struct __kernel_timespec ts{0, 50000};
        io_uring_wait_cqe_timeout(ring, &c, &ts);
      } else {
        io_uring_wait_cqe(ring, &c);
      }
    }
    sleeping_.store(0, std::memory_order_seq_cst);
    idle_spins = 0;
  }
  last_cpu_s_ = thread_cpu_seconds(clock_);
  has_clock_ = false;
}

}  // namespace tutti
