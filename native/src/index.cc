#include "index.h"

namespace tutti {

uint32_t Index::lookup_prefix(const uint64_t* keys, uint32_t n, uint32_t* in_memory) {
  std::lock_guard<std::mutex> g(mu_);
  uint32_t i = 0, mem = 0;
  for (; i < n; ++i) {
    auto it = map_.find(keys[i]);
    if (it == map_.end()) break;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    if (it->second.at.mem) {
      mem_lru_.splice(mem_lru_.begin(), mem_lru_, it->second.mem_lru);
      mem++;
    }
  }
  if (in_memory) *in_memory = mem;
  return i;
}

bool Index::contains(uint64_t key) const {
  std::lock_guard<std::mutex> g(mu_);
  return map_.count(key) != 0;
}

bool Index::find(uint64_t key, Copies* out) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  *out = it->second.at;
  return true;
}

bool Index::acquire(uint64_t key, uint32_t* slot, uint32_t* blocks) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  it->second.pins++;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  if (it->second.at.mem) mem_lru_.splice(mem_lru_.begin(), mem_lru_, it->second.mem_lru);
  *slot = it->second.at.slot;
  if (blocks) *blocks = it->second.blocks;
  return true;
}

uint32_t Index::blocks(uint64_t key) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  return it == map_.end() ? 0 : it->second.blocks;
}

bool Index::pin(uint64_t key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  it->second.pins++;
  return true;
}

void Index::unpin(uint64_t key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it != map_.end() && it->second.pins > 0) it->second.pins--;
}

void Index::insert(uint64_t key, uint32_t slot, uint32_t blocks, bool mem) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) {
    lru_.push_front(key);
    it = map_.emplace(key, Entry{{}, 0, blocks, lru_.begin(), mem_lru_.end()}).first;
  } else if (it->second.at.mem) {
    mem_lru_.erase(it->second.mem_lru);
  }
  Entry& e = it->second;
  e.at = {slot, kNoCopy, mem};
  e.blocks = blocks;
  if (mem) {
    mem_lru_.push_front(key);
    e.mem_lru = mem_lru_.begin();
  }
}

bool Index::set_copy(uint64_t key, uint32_t mem_slot, uint32_t copy) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || !it->second.at.mem || it->second.at.slot != mem_slot || it->second.at.copy != kNoCopy)
    return false;
  it->second.at.copy = copy;
  return true;
}

bool Index::promote(uint64_t key, uint32_t storage_slot, uint32_t mem_slot) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || it->second.at.mem || it->second.at.slot != storage_slot) return false;
  it->second.at = {mem_slot, storage_slot, true};
  mem_lru_.push_front(key);
  it->second.mem_lru = mem_lru_.begin();
  return true;
}

bool Index::drop_copy(uint64_t key, uint32_t slot, bool* gone) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  Copies& c = it->second.at;
  if (c.slot == slot && c.copy != kNoCopy) {  // the memory copy: the storage copy serves from now on
    mem_lru_.erase(it->second.mem_lru);
    c = {c.copy, kNoCopy, false};
    *gone = false;
    return true;
  }
  if (c.copy == slot) {
    c.copy = kNoCopy;
    *gone = false;
    return true;
  }
  if (c.slot != slot) return false;
  erase(it);
  *gone = true;
  return true;
}

void Index::erase(std::unordered_map<uint64_t, Entry>::iterator it) {
  lru_.erase(it->second.lru);
  if (it->second.at.mem) mem_lru_.erase(it->second.mem_lru);
  map_.erase(it);
}

bool Index::remove(uint64_t key, Copies* out) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  *out = it->second.at;
  erase(it);
  return true;
}

Index::Removed Index::remove_unpinned(uint64_t key, Copies* out) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return Removed::kAbsent;
  if (it->second.pins != 0) return Removed::kPinned;
  *out = it->second.at;
  erase(it);
  return Removed::kGone;
}

bool Index::evict_lru(uint64_t* key, Copies* out) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    auto m = map_.find(*it);
    const Copies& c = m->second.at;
    if (m->second.pins != 0 || (c.mem && c.copy == kNoCopy)) continue;
    *key = m->first;
    *out = c;
    erase(m);
    return true;
  }
  return false;
}

bool Index::evict_memory_lru(bool dirty_too, uint64_t* key, uint32_t* mem_slot, bool* gone) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = mem_lru_.rbegin(); it != mem_lru_.rend(); ++it) {
    auto m = map_.find(*it);
    Copies& c = m->second.at;
    if (m->second.pins != 0 || (c.copy == kNoCopy && !dirty_too)) continue;
    *key = m->first;
    *mem_slot = c.slot;
    if (c.copy == kNoCopy) {
      erase(m);
      *gone = true;
    } else {
      mem_lru_.erase(m->second.mem_lru);
      c = {c.copy, kNoCopy, false};
      *gone = false;
    }
    return true;
  }
  return false;
}

size_t Index::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return map_.size();
}

size_t Index::in_memory() const {
  std::lock_guard<std::mutex> g(mu_);
  return mem_lru_.size();
}

size_t Index::pinned() const {
  std::lock_guard<std::mutex> g(mu_);
  size_t n = 0;
  for (const auto& kv : map_) n += kv.second.pins != 0;
  return n;
}

std::vector<uint64_t> Index::keys() const {
  std::lock_guard<std::mutex> g(mu_);
  return {lru_.begin(), lru_.end()};
}

}  // namespace tutti
