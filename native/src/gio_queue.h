// gio_uring: IOCBs of IOCTXs posted by the I/O kernel, a submission and a completion ring per kernel
// worker, and the doorbells; the host agent that drains the submission rings with io_uring is in
// agent.h.
//
// "CPU prepares, device executes": the engine thread fills IOCBs once per layer (get_iocb/issue_io),
// the I/O kernel (a GPU kernel on dedicated SMs, or the CPU backend's scatter worker standing in for
// it) turns every IOCTX into storage requests on its SQ, and moves the bytes between staging and the
// paged KV blocks when their CQEs arrive. The agent sits where an NVMe controller would: a GPU-direct
// NVMe backend replaces it by queue pairs that the kernel rings itself, with the rest unchanged.
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>

#include "ring.h"
#include "tutti/gio_uring.h"

namespace tutti {

// One object transfer of a request: a GPU file (slot) and the extents of the unit's KV blocks.
// The layer is a property of the IOCB, so one IOCTX array serves every layer of a request.
struct Ioctx {
  uint64_t file_offset;   // slot start in its pool file
  uint32_t path;          // pool path index (registered file index)
  uint32_t unit;          // unit index inside the request
  uint32_t slot;          // or kNoSlot
  uint32_t obj;           // object index inside the layer (K = 0, V = 1)
  uint32_t extent_first;  // into the request's extent array
  uint32_t extent_count;
};

// An IOCB: up to 2048 IOCTXs of one request, one op, one layer.
struct Iocb {
  uint32_t op;
  uint32_t layer;
  uint32_t request;
  uint32_t ctx_first;
  uint32_t ctx_count;
  uint32_t in_use;       // engine-owned
  uint64_t issue_seq;    // engine: bumped at issue
  uint64_t done_seq;     // kernel: set to issue_seq when every IOCTX is done
  uint64_t errors;       // kernel: IOCTXs that failed (I/O error or checksum mismatch)
};

// A storage request on an SQ (kernel -> agent) and its completion on a CQ (agent -> kernel).
struct Sqe {
  uint64_t tag;          // opaque to the agent
  uint64_t file_offset;
  uint64_t buf_offset;   // into the registered staging region
  uint32_t len;
  uint16_t path;
  uint16_t op;           // IoOp::kRead, kWrite, kReadv or kWritev
};
struct Cqe {
  uint64_t tag;
  int64_t res;           // bytes moved, or -errno
};

// Memory of one SQ/CQ pair: control blocks plus entries, in one allocation that both sides map.
struct QueuePair {
  RingCtl* sq_ctl = nullptr;
  Sqe* sq = nullptr;
  RingCtl* cq_ctl = nullptr;
  Cqe* cq = nullptr;
  uint64_t depth = 0;
  SpscRing<Sqe> sq_ring() const { return {sq_ctl, sq, depth}; }
  SpscRing<Cqe> cq_ring() const { return {cq_ctl, cq, depth}; }
};

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_us);
// CPU seconds used so far by the thread whose clock is `clock`.
double thread_cpu_seconds(clockid_t clock);
void futex_wake_all(std::atomic<uint32_t>* word);

// Wakes sleeping consumers; `notify` costs one fence when nobody sleeps.
class Doorbell {
 public:
  void notify() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) != 0) {
      word_.fetch_add(1, std::memory_order_seq_cst);
      futex_wake_all(&word_);
    }
  }
  // Blocks until notified or `timeout_us` passes, unless `ready()` holds after announcing sleep.
  template <typename Ready>
  void wait(Ready ready, int timeout_us) {
    uint32_t v = word_.load(std::memory_order_seq_cst);
    sleeping_.fetch_add(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!ready()) futex_wait(&word_, v, timeout_us);
    sleeping_.fetch_sub(1, std::memory_order_seq_cst);
  }

 private:
  std::atomic<uint32_t> sleeping_{0};
  std::atomic<uint32_t> word_{0};
};

}  // namespace tutti
