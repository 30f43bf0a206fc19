// Lock-free single-producer single-consumer rings for memory shared by two agents (CPU threads, or a
// GPU thread block and a CPU thread). One writer per word: `head` is written only by the producer,
// `tail` only by the consumer. Sequence numbers are 64-bit and monotonic,
// so they never wrap in practice. Host code publishes with release stores and reads with acquire
// loads; the CUDA side uses cuda::atomic_ref with system scope on the same words.
#pragma once

#include <cstdint>
#include <cstring>

namespace tutti {

struct alignas(64) RingCtl {
  uint64_t head;  // entries pushed (producer)
  uint8_t pad0[56];
  uint64_t tail;  // entries popped (consumer)
  uint8_t pad1[56];
};

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// Host view of a ring whose control block and entries live in caller-provided memory.
template <typename T>
class SpscRing {
 public:
  SpscRing() = default;
  SpscRing(RingCtl* ctl, T* entries, uint64_t capacity) : ctl_(ctl), entries_(entries), cap_(capacity) {}

  uint64_t capacity() const { return cap_; }
  bool push(const T& v) {
    uint64_t h = ctl_->head;  // own word
    if (h - load_acquire(&ctl_->tail) >= cap_) return false;
    entries_[h % cap_] = v;
    store_release(&ctl_->head, h + 1);
    return true;
  }
  bool pop(T* v) {
    uint64_t t = ctl_->tail;  // own word
    if (load_acquire(&ctl_->head) == t) return false;
    *v = entries_[t % cap_];
    store_release(&ctl_->tail, t + 1);
    return true;
  }
  bool empty() const { return load_acquire(&ctl_->head) == load_acquire(&ctl_->tail); }
  uint64_t size() const { return load_acquire(&ctl_->head) - load_acquire(&ctl_->tail); }
  RingCtl* ctl() const { return ctl_; }

 private:
  RingCtl* ctl_ = nullptr;
  T* entries_ = nullptr;
  uint64_t cap_ = 0;
};

}  // namespace tutti
