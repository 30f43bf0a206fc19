// The host agent (agent.cc): drains the kernel workers' submission rings with io_uring.
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "gio_queue.h"
#include "tutti/common.h"

namespace tutti {

// The host agent: one thread, one io_uring, registered pool files and staging buffer.
class Agent {
 public:
  struct Options {
    uint32_t depth = 64;
    std::vector<int> fds;
    void* staging = nullptr;
    uint64_t staging_bytes = 0;
    bool poll_rings = false;  // spin on the SQs (the producer is a GPU that cannot ring a doorbell)
    // Per registered file: hand its requests to io_uring's worker threads (IOSQE_ASYNC). Requests
    // that complete inline (page-cache hits, tmpfs even with O_DIRECT) are otherwise copied by the
    // agent thread one at a time; O_DIRECT files on block devices need no punting.
    std::vector<uint8_t> punt;
  };
  ~Agent();
  Status start(const Options& opt, std::vector<QueuePair> queues, Doorbell* consumer_bell);
  void stop();
  // The eventfd a host producer writes to wake the agent (after pushing to an SQ).
  void kick();
  uint64_t ops() const { return ops_.load(std::memory_order_relaxed); }
  double cpu_seconds() const;  // CPU time used by the agent thread
  bool fixed_buffers() const { return fixed_bufs_; }

 private:
  void run();
  Options opt_;
  std::vector<QueuePair> queues_;
  Doorbell* consumer_bell_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> sleeping_{0};
  int efd_ = -1;
  void* ring_ = nullptr;  // struct io_uring*, kept opaque in the header
  bool fixed_bufs_ = false;
  std::atomic<uint64_t> ops_{0};
  std::atomic<bool> has_clock_{false};
  clockid_t clock_{};  // the agent thread's CPU clock, read on demand by stats()
  double last_cpu_s_ = 0;
};

}  // namespace tutti
