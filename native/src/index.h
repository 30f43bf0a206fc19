// The CPU-side index: cache-unit key -> slot and the unit's KV blocks, with LRU order and pins.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace tutti {

class Index {
 public:
  // Number of leading keys present; touches them (most recently used).
  uint32_t lookup_prefix(const uint64_t* keys, uint32_t n);
  bool contains(uint64_t key) const;
  // Pins `key` and returns its slot (and its blocks); false when absent.
  bool acquire(uint64_t key, uint32_t* slot, uint32_t* blocks = nullptr);
  // KV blocks the unit holds (0: absent).
  uint32_t blocks(uint64_t key) const;
  bool pin(uint64_t key);
  void unpin(uint64_t key);
  // Inserts a committed unit. `seq` orders recovery inserts (older first = less recently used).
  void insert(uint64_t key, uint32_t slot, uint32_t blocks);
  // Removes `key`'s entry whatever its pins (recovery: an older copy; a unit found damaged) and,
  // with `only_slot`, only while it is in that slot (a request dropping the unit it read).
  static constexpr uint32_t kAnySlot = ~0u;
  bool remove(uint64_t key, uint32_t* slot, uint32_t only_slot = kAnySlot);
  // Removes `key`'s entry only while nothing pins it: its owner's pins, or a retrieve reading its slot.
  enum class Removed { kGone, kAbsent, kPinned };
  Removed remove_unpinned(uint64_t key, uint32_t* slot);
  // Removes the least recently used unpinned entry.
  bool evict_lru(uint64_t* key, uint32_t* slot);
  size_t size() const;
  size_t pinned() const;
  std::vector<uint64_t> keys() const;

 private:
  struct Entry {
    uint32_t slot;
    uint32_t pins;
    uint32_t blocks;
    std::list<uint64_t>::iterator lru;
  };
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> map_;
  std::list<uint64_t> lru_;  // front: most recently used
};

}  // namespace tutti
