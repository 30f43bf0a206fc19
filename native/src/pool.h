// File pool: one preallocated pool file per storage path, cut into fixed-size GPU-file slots.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "tutti/common.h"
#include "tutti/layout.h"
#include "tutti/options.h"

struct io_uring;

namespace tutti {

// One pool file. A storage path holds one or more of them (`files_per_path`): io_uring serialises
// its worker threads' writes per file, so memory-backed paths get several files to write in parallel.
struct PoolPath {
  std::string dir;
  std::string file;
  uint32_t dir_index = 0;  // which storage path (SSD) the file is on
  Tier tier = Tier::kStorage;
  uint64_t capacity = 0;   // bytes this instance may use in this file
  int fd = -1;
  bool direct = false;    // O_DIRECT accepted by the file system
  bool fresh = false;     // empty when this open locked it (preallocated by this open)
  bool created = false;   // made by this open, which holds its lock: removed again if the open fails
  bool memory = false;    // tmpfs, ramfs or hugetlbfs: requests complete inline unless punted to io_uring workers
  // hugetlbfs: its page size. Such a file takes no write(2): it is mapped whole when opened (`map`)
  // and every byte this process moves in or out of it goes through that mapping.
  uint64_t huge_page = 0;
  // Served from memory or the page cache: requests complete inline and take any buffer.
  bool cached() const { return memory || !direct; }
  // O_DIRECT: the alignment (a power of two) that every buffer address and length of one I/O
  // needs: the file system's own (statx STATX_DIOALIGN) where it says, else 4096; 1 when cached().
  uint32_t buffer_align = 1;
  uint32_t first_slot = 0;
  uint32_t num_slots = 0;
  uint8_t* map = nullptr;  // the whole file, mapped shared (map_memory_files), or null
  uint64_t map_bytes = 0;
};

// How a writer makes pool files and which existing files it takes (FilePool::open).
struct PoolFileOptions {
  // Group the files are given to, with mode 0640; -1: owner only, mode 0600. The mode is set on
  // every file a writer opens, whatever the umask (a file made by an older build is tightened).
  int64_t gid = -1;
  // Write this layout's free-slot header (encode_free_header with `desc`) into the first slot of a
  // new (empty) file before it is preallocated, so that the file is a pool of ours from the start:
  // a writer takes an existing non-empty file only when it begins with the header magic.
  bool stamp = false;
  std::string desc;
};

class FilePool {
 public:
  FilePool() = default;
  FilePool(const FilePool&) = delete;
  FilePool& operator=(const FilePool&) = delete;
  ~FilePool();

  // Opens (creating and fallocating when needed) the pool files of every path and takes an exclusive
  // lock on each, so one process owns one share: `<dir>/tutti-<instance>.pool`, and with
  // `files_per_path` > 1 also `<dir>/tutti-<instance>.<k>.pool`; the capacity of a path is split
  // evenly. `tiers` gives each path's tier (all storage when empty); a memory-tier path must be on
  // a memory file system (ConfigError otherwise). 0 files per path means: 16 on memory file systems (tmpfs, ramfs, hugetlbfs; fewer where the
  // capacity holds fewer GPU files), 1 elsewhere. Files are
  // ordered so that consecutive slots go to different paths. `read_only` opens the existing files
  // without lock, for readers such as the node daemon. `prewrite` writes zeros once over what
  // fallocate left unwritten (O_DIRECT files on block devices), so that stores overwrite in place,
  // and touches the pages of new files on memory file systems once.
  //
  // Files are trusted only as far as they are ours (StorageError naming the file and what was
  // found otherwise): every file is opened without following a symbolic link at its name (a
  // storage directory itself may be one) and without waiting on a FIFO, and must be a regular
  // file; a writer also needs it owned by the effective uid, with one link, and either empty or
  // beginning with the header magic (a pool of any layout: recovery then tells a layout apart).
  // New files are made with O_EXCL and the mode of `files`; one this open made is removed again
  // when the open fails (no space to preallocate, say), one that was empty is cut back to empty.
  Status open(const std::vector<std::string>& dirs, const std::vector<uint64_t>& capacity,
              const std::string& instance, const Geometry& g, DirectMode mode, bool read_only,
              uint32_t files_per_path = 1, bool prewrite = false, const PoolFileOptions& files = {},
              const std::vector<Tier>& tiers = {});
  void close();
  // Maps every pool file on a memory file system (tmpfs, ramfs; hugetlbfs files are mapped at open),
  // only the memory tier's where there is one, shared and populated, so that the
  // I/O kernel can move objects between it and the KV blocks with loads and stores (byte-addressable
  // storage); other files stay unmapped. Undone by close().
  Status map_memory_files();

  uint32_t num_slots() const { return num_slots_; }
  uint32_t num_slots(Tier t) const { return tier_slots_[static_cast<int>(t)]; }
  bool has_memory_tier() const { return num_slots(Tier::kMemory) != 0; }
  Tier tier_of(uint32_t slot) const { return paths_[slot_path_[slot]].tier; }
  // Pool files ("paths" of the I/O layer: an SQE names one by its registered index).
  uint32_t num_paths() const { return static_cast<uint32_t>(paths_.size()); }
  const PoolPath& path(uint32_t p) const { return paths_[p]; }
  uint32_t path_of(uint32_t slot) const { return slot_path_[slot]; }
  uint64_t offset_of(uint32_t slot) const {
    return static_cast<uint64_t>(slot - paths_[slot_path_[slot]].first_slot) * slot_bytes_;
  }

  // Free-slot management. Allocation goes round-robin over the paths of a tier, so consecutive
  // cache units of a prefix are striped across the storage devices.
  bool alloc(uint32_t* slot, Tier t = Tier::kStorage);
  void release(uint32_t slot);
  // Recovery: rebuilds the free lists from the slots found in use (one pass).
  void set_used(const std::vector<uint8_t>& used);
  uint32_t free_slots() const;
  uint32_t free_slots(Tier t) const;

  // Synchronous I/O (headers, flushes, imports); `buf` is 4 KiB aligned. A copy through the mapping
  // on hugetlbfs.
  Status pread_all(uint32_t slot, uint64_t off, void* buf, uint64_t n) const;
  Status pwrite_all(uint32_t slot, uint64_t off, const void* buf, uint64_t n) const;
  // Writes `n` buffers of `bytes` each (buffer i at bufs + i * bytes, 4 KiB aligned) at the start of
  // slots[i], in batches through one io_uring (a syscall per batch, on the calling thread); a write
  // that fails or comes up short, or every write where io_uring is unavailable, is tried once more
  // with pwrite_all. ok[i]: buffer i is written in full.
  void write_slot_heads(const uint32_t* slots, const uint8_t* bufs, uint64_t bytes, uint32_t n, uint8_t* ok) const;

 private:
  std::vector<PoolPath> paths_;
  std::vector<uint32_t> slot_path_;
  uint64_t slot_bytes_ = 0;
  uint32_t num_slots_ = 0;
  mutable std::mutex mu_;
  std::vector<std::vector<uint32_t>> free_;  // per path
  uint32_t next_path_[2] = {0, 0};  // per tier
  uint32_t tier_slots_[2] = {0, 0};
  mutable std::mutex ring_mu_;      // write_slot_heads
  mutable io_uring* ring_ = nullptr;  // made at the first write_slot_heads
  mutable bool ring_failed_ = false;
};

}  // namespace tutti
