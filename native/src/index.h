// The CPU-side index: cache-unit key -> slot and the unit's KV blocks, with LRU order and pins.
// With a memory tier a unit may have two copies: `slot`, its fastest (in memory when `mem`), and
// `copy`, its storage copy behind a memory one (kNoCopy when none). Slots' tiers are the pool's.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace tutti {

class Index {
 public:
  static constexpr uint32_t kNoCopy = ~0u;
  // Where a unit lies: its fastest copy, the storage copy behind a memory one, and whether the
  // fastest is in memory.
  struct Copies {
    uint32_t slot = kNoCopy, copy = kNoCopy;
    bool mem = false;
  };
  // Number of leading keys present; touches them (most recently used). *in_memory: how many of
  // them have their fastest copy in memory.
  uint32_t lookup_prefix(const uint64_t* keys, uint32_t n, uint32_t* in_memory = nullptr);
  bool contains(uint64_t key) const;
  bool find(uint64_t key, Copies* out) const;
  // Pins `key` and returns its fastest slot (and its blocks); false when absent.
  bool acquire(uint64_t key, uint32_t* slot, uint32_t* blocks = nullptr);
  // KV blocks the unit holds (0: absent).
  uint32_t blocks(uint64_t key) const;
  bool pin(uint64_t key);
  void unpin(uint64_t key);
  // Inserts a committed unit with one copy (`mem`: in the memory tier), or replaces the entry's
  // copies with that one. Recovery inserts older first (less recently used).
  void insert(uint64_t key, uint32_t slot, uint32_t blocks, bool mem = false);
  // A memory unit's storage copy is committed in `copy` (flush): false, changing nothing, unless
  // the key's fastest copy still is `mem_slot` and has no storage copy.
  bool set_copy(uint64_t key, uint32_t mem_slot, uint32_t copy);
  // A storage unit's copy is committed in `mem_slot` (promotion): false, changing nothing, unless
  // the key still lies in `storage_slot` alone.
  bool promote(uint64_t key, uint32_t storage_slot, uint32_t mem_slot);
  // Drops one copy of `key`, the one in `slot` (a damaged copy): the entry stays while the other
  // copy does (*gone false). False when the key holds no copy there.
  bool drop_copy(uint64_t key, uint32_t slot, bool* gone);
  // Removes `key`'s entry whatever its pins (recovery: an older copy).
  bool remove(uint64_t key, Copies* out);
  // Removes `key`'s entry only while nothing pins it: its owner's pins, or a retrieve reading its slot.
  enum class Removed { kGone, kAbsent, kPinned };
  Removed remove_unpinned(uint64_t key, Copies* out);
  // Makes room in the storage tier: removes the least recently used unpinned unit with a storage
  // copy (both its copies).
  bool evict_lru(uint64_t* key, Copies* out);
  // Makes room in the memory tier: the least recently used unpinned unit in memory. A unit with a
  // storage copy keeps it (demoted, *gone false); with `dirty_too`, a unit in memory only is
  // removed (*gone true), else it is skipped.
  bool evict_memory_lru(bool dirty_too, uint64_t* key, uint32_t* mem_slot, bool* gone);
  size_t size() const;
  size_t in_memory() const;
  size_t pinned() const;
  std::vector<uint64_t> keys() const;

 private:
  struct Entry {
    Copies at;
    uint32_t pins;
    uint32_t blocks;
    std::list<uint64_t>::iterator lru, mem_lru;
  };
  void erase(std::unordered_map<uint64_t, Entry>::iterator it);  // under mu_
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> map_;
  std::list<uint64_t> lru_;      // every unit; front: most recently used
  std::list<uint64_t> mem_lru_;  // units in memory, in the same order
};

}  // namespace tutti
