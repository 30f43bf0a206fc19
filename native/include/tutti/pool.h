// File pool: one preallocated pool file per storage path, cut into fixed-size GPU-file slots.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "tutti/common.h"
#include "tutti/layout.h"

namespace tutti {

enum class DirectMode : int { kAuto = 0, kOn = 1, kOff = 2 };

struct PoolPath {
  std::string dir;
  std::string file;
  uint64_t capacity = 0;  // bytes this instance may use on this path
  int fd = -1;
  bool direct = false;    // O_DIRECT accepted by the file system
  uint32_t first_slot = 0;
  uint32_t num_slots = 0;
};

class FilePool {
 public:
  FilePool() = default;
  FilePool(const FilePool&) = delete;
  FilePool& operator=(const FilePool&) = delete;
  ~FilePool();

  // Opens (creating and fallocating when needed) `<dir>/tutti-<instance>.pool` on every path and takes an
  // exclusive lock on it, so one process owns one share. `read_only` opens existing files without lock,
  // for readers such as the node daemon.
  Status open(const std::vector<std::string>& dirs, const std::vector<uint64_t>& capacity,
              const std::string& instance, const Geometry& g, DirectMode mode, bool read_only);
  void close();

  uint32_t num_slots() const { return num_slots_; }
  uint32_t num_paths() const { return static_cast<uint32_t>(paths_.size()); }
  const PoolPath& path(uint32_t p) const { return paths_[p]; }
  uint32_t path_of(uint32_t slot) const { return slot_path_[slot]; }
  uint64_t offset_of(uint32_t slot) const {
    return static_cast<uint64_t>(slot - paths_[slot_path_[slot]].first_slot) * slot_bytes_;
  }

  // Free-slot management. Allocation goes round-robin over the paths, so consecutive cache units
  // of a prefix are striped across the storage devices.
  bool alloc(uint32_t* slot);
  void release(uint32_t slot);
  void mark_used(uint32_t slot);  // during recovery
  uint32_t free_slots() const;

  // Synchronous header I/O (recovery, invalidation before reuse); `buf` is 4 KiB aligned.
  Status pread_all(uint32_t slot, uint64_t off, void* buf, uint64_t n) const;
  Status pwrite_all(uint32_t slot, uint64_t off, const void* buf, uint64_t n) const;

 private:
  std::vector<PoolPath> paths_;
  std::vector<uint32_t> slot_path_;
  uint64_t slot_bytes_ = 0;
  uint32_t num_slots_ = 0;
  mutable std::mutex mu_;
  std::vector<std::vector<uint32_t>> free_;  // per path
  uint32_t next_path_ = 0;
};

}  // namespace tutti
