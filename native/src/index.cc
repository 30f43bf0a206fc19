#include "index.h"

namespace tutti {

uint32_t Index::lookup_prefix(const uint64_t* keys, uint32_t n) {
  std::lock_guard<std::mutex> g(mu_);
  uint32_t i = 0;
  for (; i < n; ++i) {
    auto it = map_.find(keys[i]);
    if (it == map_.end()) break;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  return i;
}

bool Index::contains(uint64_t key) const {
  std::lock_guard<std::mutex> g(mu_);
  return map_.count(key) != 0;
}

bool Index::acquire(uint64_t key, uint32_t* slot, uint32_t* blocks) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  it->second.pins++;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  *slot = it->second.slot;
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

void Index::insert(uint64_t key, uint32_t slot, uint32_t blocks) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it != map_.end()) {
    it->second.slot = slot;
    it->second.blocks = blocks;
    return;
  }
  lru_.push_front(key);
  map_.emplace(key, Entry{slot, 0, blocks, lru_.begin()});
}

bool Index::remove(uint64_t key, uint32_t* slot, uint32_t only_slot) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || (only_slot != kAnySlot && it->second.slot != only_slot)) return false;
  *slot = it->second.slot;
  lru_.erase(it->second.lru);
  map_.erase(it);
  return true;
}

Index::Removed Index::remove_unpinned(uint64_t key, uint32_t* slot) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return Removed::kAbsent;
  if (it->second.pins != 0) return Removed::kPinned;
  *slot = it->second.slot;
  lru_.erase(it->second.lru);
  map_.erase(it);
  return Removed::kGone;
}

bool Index::evict_lru(uint64_t* key, uint32_t* slot) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    auto m = map_.find(*it);
    if (m->second.pins != 0) continue;
    *key = m->first;
    *slot = m->second.slot;
    lru_.erase(m->second.lru);
    map_.erase(m);
    return true;
  }
  return false;
}

size_t Index::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return map_.size();
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
