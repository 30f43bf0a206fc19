#include "pool.h"

#include <fcntl.h>
#include <liburing.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/file.h>
#include <sys/statfs.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "header.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace tutti {

FilePool::~FilePool() { close(); }

void FilePool::close() {
  if (ring_) {
    io_uring_queue_exit(ring_);
    delete ring_;
    ring_ = nullptr;
  }
  for (PoolPath& p : paths_) {
    if (p.map) ::munmap(p.map, p.map_bytes);
    p.map = nullptr;
    p.map_bytes = 0;
    // Unlock explicitly: io_uring may hold its registered file reference a little past close().
    if (p.fd >= 0) {
      ::flock(p.fd, LOCK_UN);
      ::close(p.fd);
    }
    p.fd = -1;
  }
}

// Writes zeros over the parts of [0, bytes) that the file system keeps as unwritten extents (what
// fallocate leaves on ext4 and XFS). An O_DIRECT write into an unwritten extent must convert it,
// which takes the file's lock exclusively and sends io_uring's write to a worker that is
// serialised per file; an overwrite of written blocks goes straight to the device. Asking FIEMAP
// for the unwritten extents makes this cheap on every later start and resumes a start that was
// killed half way. File systems without FIEMAP or unwritten extents are left as they are.
// Data still in the page cache (a pool copied with buffered writes a moment ago) has no blocks yet,
// and fallocate gives it unwritten ones: the caller syncs the file before fallocate, and FIEMAP
// syncs again (FIEMAP_FLAG_SYNC), so such data is on its blocks, written, before we look.
static Status write_unwritten(const PoolPath& p, uint64_t bytes) {
  constexpr uint32_t kExtents = 64;
  constexpr uint64_t kChunk = 8ull << 20;
  std::unique_ptr<uint8_t[]> raw(new uint8_t[sizeof(fiemap) + kExtents * sizeof(fiemap_extent)]);
  auto* fm = reinterpret_cast<fiemap*>(raw.get());
  void* zeros = nullptr;
  uint64_t start = 0;
  Status st;
  while (start < bytes && st.ok()) {
    std::memset(fm, 0, sizeof(fiemap) + kExtents * sizeof(fiemap_extent));
    fm->fm_start = start;
    fm->fm_length = bytes - start;
    fm->fm_flags = FIEMAP_FLAG_SYNC;
    fm->fm_extent_count = kExtents;
    if (::ioctl(p.fd, FS_IOC_FIEMAP, fm) != 0 || fm->fm_mapped_extents == 0) break;
    for (uint32_t i = 0; i < fm->fm_mapped_extents && st.ok(); ++i) {
      const fiemap_extent& e = fm->fm_extents[i];
      start = e.fe_logical + e.fe_length;
      // Only plain unwritten extents; anything the file system cannot describe yet is left alone.
      if ((e.fe_flags & (FIEMAP_EXTENT_UNWRITTEN | FIEMAP_EXTENT_DELALLOC | FIEMAP_EXTENT_UNKNOWN)) !=
          FIEMAP_EXTENT_UNWRITTEN)
        continue;
      if (!zeros) {
        if (::posix_memalign(&zeros, kAlign, kChunk) != 0) {
          zeros = nullptr;
          st = {Code::kCapacityExceeded, "out of memory"};
          break;
        }
        std::memset(zeros, 0, kChunk);
      }
      for (uint64_t off = e.fe_logical, end = std::min(start, bytes); off < end && st.ok();) {
        const ssize_t w = ::pwrite(p.fd, zeros, std::min(kChunk, end - off), static_cast<off_t>(off));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) st = {errno == ENOSPC ? Code::kCapacityExceeded : Code::kStorage, errno_message("write " + p.file, errno)};
        else off += static_cast<uint64_t>(w);
      }
    }
    if (fm->fm_extents[fm->fm_mapped_extents - 1].fe_flags & FIEMAP_EXTENT_LAST) break;
  }
  std::free(zeros);
  if (st.ok() && zeros && ::fdatasync(p.fd) != 0) st = {Code::kStorage, errno_message("fdatasync " + p.file, errno)};
  return st;
}

// The buffer alignment that O_DIRECT I/O on `fd` needs (addresses and lengths alike): the larger of
// the file system's memory and offset alignments where statx reports them, else a page.
static uint32_t direct_buffer_align(int fd) {
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_mem_align > 0 && sx.stx_dio_offset_align > 0) {
    const uint32_t a = std::max(sx.stx_dio_mem_align, sx.stx_dio_offset_align);
    if ((a & (a - 1)) == 0 && a <= 4096) return a;
  }
#endif
  (void)fd;
  return 4096;
}

static const char* file_kind(mode_t m) {
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "not a regular file";
}

static Status refuse(const std::string& file, const std::string& what) {
  return {Code::kStorage, "refusing pool file " + file + ": " + what};
}

// Opens `file` without following a symbolic link at its name and without waiting (a FIFO opens at
// once and is refused by the caller's fstat). O_DIRECT comes later, by fcntl (set_flags).
static int open_file(const std::string& file, int flags, mode_t mode = 0) {
  int fd;
  do fd = ::open(file.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode);
  while (fd < 0 && errno == EINTR);
  return fd;
}

// The error of an open that failed with `err`: what is at the name when it is not a regular file.
static Status open_error(const std::string& file, int err) {
  struct stat st;
  if (err != ENOENT && ::lstat(file.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return refuse(file, std::string("it is ") + file_kind(st.st_mode) + " (a pool file must be a regular file)");
  return {Code::kStorage, errno_message("open " + file, err)};
}

// A regular file of this user, and for a writer one with no other name (a hard link placed at the
// pool's name may be anyone's file). A reader also takes a file of another user whose group is the
// configured file group `gid` (a daemon running as another user than its engines); any other
// user's file is one planted by someone who can write the storage directory, whose units the node
// would otherwise index, advertise and serve as its own.
static Status check_file(const std::string& file, int fd, bool writer, int64_t gid, struct stat* st) {
  if (::fstat(fd, st) != 0) return {Code::kStorage, errno_message("stat " + file, errno)};
  if (!S_ISREG(st->st_mode)) return refuse(file, std::string("it is ") + file_kind(st->st_mode) + " (a pool file must be a regular file)");
  const bool group_shared = !writer && gid >= 0 && st->st_gid == static_cast<gid_t>(gid);
  if (st->st_uid != ::geteuid() && !group_shared)
    return refuse(file, "it is owned by uid " + std::to_string(st->st_uid) + ", not by this process's uid " +
                            std::to_string(::geteuid()) +
                            (writer ? std::string() : std::string(" (a reader running as another user needs file_group)")));
  if (!writer) return Status::Ok();
  if (st->st_nlink > 1)
    return refuse(file, "it has " + std::to_string(st->st_nlink) + " hard links (a pool file has one name)");
  return Status::Ok();
}

// Blocking from here on, and O_DIRECT where the mode asks and the file system takes it.
static Status set_flags(PoolPath* p, DirectMode mode) {
  const int fl = ::fcntl(p->fd, F_GETFL);
  if (fl < 0) return {Code::kStorage, errno_message("fcntl " + p->file, errno)};
  p->direct = false;
  if (mode != DirectMode::kOff) {
    if (::fcntl(p->fd, F_SETFL, (fl & ~O_NONBLOCK) | O_DIRECT) == 0) {
      p->direct = true;
      return Status::Ok();
    }
    if (errno != EINVAL) return {Code::kStorage, errno_message("fcntl " + p->file, errno)};
    if (mode == DirectMode::kOn) return {Code::kStorage, "O_DIRECT refused by the file system of " + p->dir + " (direct_io=on)"};
  }
  if (::fcntl(p->fd, F_SETFL, fl & ~(O_NONBLOCK | O_DIRECT)) != 0)  // tmpfs and friends refuse O_DIRECT
    return {Code::kStorage, errno_message("fcntl " + p->file, errno)};
  return Status::Ok();
}

// Whether a non-empty file is a pool of ours: it begins with the header magic (the first slot of
// every pool file holds a header from its creation on). The checksum is not asked for: a torn or
// damaged first header is a miss for recovery to count, not a reason to refuse the whole file.
static Status check_ours(const PoolPath& p, uint64_t size) {
  const std::string foreign = "it is a non-empty file of " + std::to_string(size) +
                              " bytes that is not a Tutti pool (it is never overwritten; move it away or use "
                              "another path or instance name)";
  if (size < kAlign) return refuse(p.file, foreign);
  void* buf = nullptr;
  if (::posix_memalign(&buf, kAlign, kAlign) != 0) return {Code::kCapacityExceeded, "out of memory"};
  ssize_t r;
  do r = ::pread(p.fd, buf, kAlign, 0);
  while (r < 0 && errno == EINTR);
  const int err = errno;
  uint64_t magic = 0;
  if (r >= static_cast<ssize_t>(sizeof(magic))) std::memcpy(&magic, buf, sizeof(magic));
  std::free(buf);
  if (r < 0) return {Code::kStorage, errno_message("read " + p.file, err)};
  if (magic != kHeaderMagic) return refuse(p.file, foreign);
  return Status::Ok();
}

// Opens (a writer: creating when absent) and checks one pool file, leaving p->fd set (also on
// failure, for the caller's clean-up) and, for a writer, locked.
static Status open_file_checked(PoolPath* p, DirectMode mode, bool read_only, int64_t gid) {
  const mode_t file_mode = gid >= 0 ? 0640 : 0600;
  for (int attempt = 0; attempt < 8; ++attempt) {
    bool created = false;
    int fd = open_file(p->file, read_only ? O_RDONLY : O_RDWR);
    if (fd < 0 && errno == ENOENT && read_only) return {Code::kNotFound, errno_message("pool file " + p->file, errno)};
    if (fd < 0 && errno == ENOENT) {
      fd = open_file(p->file, O_RDWR | O_CREAT | O_EXCL, file_mode);
      created = fd >= 0;
      if (fd < 0 && errno == EEXIST) continue;  // made by someone else a moment ago: open it as it is
    }
    if (fd < 0) return open_error(p->file, errno);
    p->fd = fd;
    struct stat st;
    Status s = check_file(p->file, fd, !read_only, gid, &st);
    if (!s.ok()) return s;
    if (read_only) return set_flags(p, mode);
    // A process that just died may hold the lock a moment longer: the kernel drops its io_uring's
    // file references asynchronously. Give that up to two seconds.
    for (int tries = 0; ::flock(fd, LOCK_EX | LOCK_NB) != 0; ++tries) {
      if (errno != EWOULDBLOCK || tries == 40)
        return {Code::kConfig, "pool file " + p->file + " is in use by another process (one instance per process)"};
      ::usleep(50000);
    }
    // Only under the lock: another process's file is never taken for one this open made, and a
    // file its maker removed again while this open waited for the lock is opened anew.
    if (::fstat(fd, &st) != 0) return {Code::kStorage, errno_message("stat " + p->file, errno)};
    if (st.st_nlink == 0) {
      ::flock(fd, LOCK_UN);
      ::close(fd);
      p->fd = -1;
      continue;
    }
    p->created = created;
    p->fresh = st.st_size == 0;
    s = set_flags(p, mode);  // under the lock: a file this open made is removed if O_DIRECT is refused
    if (!s.ok()) return s;
    if (!p->fresh) {
      s = check_ours(*p, static_cast<uint64_t>(st.st_size));
      if (!s.ok()) return s;
    }
    // The group first: where it is refused, the mode stays as it was (never opened to the group
    // the file happens to have). Then the mode whatever the umask was, on new files and on files
    // an older build made.
    if (gid >= 0 && st.st_gid != static_cast<gid_t>(gid) && ::fchown(fd, static_cast<uid_t>(-1), static_cast<gid_t>(gid)) != 0)
      return {Code::kStorage, errno_message("chgrp " + p->file + " to gid " + std::to_string(gid) +
                                                " (this user must be a member of file_group)", errno)};
    if ((st.st_mode & 07777) != file_mode && ::fchmod(fd, file_mode) != 0)
      return {Code::kStorage, errno_message("chmod " + p->file, errno)};
    return Status::Ok();
  }
  return {Code::kStorage, "pool file " + p->file + " keeps being made and removed by another process"};
}

static Status write_head(const PoolPath* p, const void* hdr, uint64_t n) {
  ssize_t w;
  do w = ::pwrite(p->fd, hdr, n, 0);
  while (w < 0 && errno == EINTR);
  if (w < 0) return {errno == ENOSPC ? Code::kCapacityExceeded : Code::kStorage, errno_message("write " + p->file, errno)};
  if (static_cast<uint64_t>(w) != n) return {Code::kStorage, "short write to " + p->file};
  return Status::Ok();
}

// The same on hugetlbfs (no write(2)): its first page, allocated and mapped for the copy.
static Status write_huge_head(const PoolPath* p, const void* hdr, uint64_t n) {
  const int rc = ::posix_fallocate(p->fd, 0, static_cast<off_t>(p->huge_page));
  if (rc != 0)
    return {rc == ENOSPC ? Code::kCapacityExceeded : Code::kStorage,
            errno_message("fallocate " + p->file + " (hugetlbfs: free huge pages, /proc/sys/vm/nr_hugepages)", rc)};
  void* m = ::mmap(nullptr, p->huge_page, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, 0);
  if (m == MAP_FAILED) return {Code::kStorage, errno_message("mmap " + p->file, errno)};
  std::memcpy(m, hdr, n);
  ::munmap(m, p->huge_page);
  return Status::Ok();
}

// Maps a hugetlbfs pool file whole (`bytes`, or its size when 0), shared and populated.
static Status map_huge(PoolPath* p, uint64_t bytes, bool read_only) {
  struct stat st;
  if (bytes == 0) {
    if (::fstat(p->fd, &st) != 0) return {Code::kStorage, errno_message("stat " + p->file, errno)};
    bytes = static_cast<uint64_t>(st.st_size) / p->huge_page * p->huge_page;
  }
  if (bytes == 0) return Status::Ok();
  void* m = ::mmap(nullptr, bytes, read_only ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, p->fd, 0);
  if (m == MAP_FAILED) return {Code::kStorage, errno_message("mmap " + p->file, errno)};
  p->map = static_cast<uint8_t*>(m);
  p->map_bytes = bytes;
  return Status::Ok();
}

static Status open_one(PoolPath* p, uint64_t bytes, DirectMode mode, bool read_only, bool prewrite,
                       const PoolFileOptions& files, const Geometry& g) {
  struct stat st;
  if (::stat(p->dir.c_str(), &st) != 0) return {Code::kStorage, errno_message("storage path " + p->dir, errno)};
  if (!S_ISDIR(st.st_mode)) return {Code::kStorage, "storage path " + p->dir + " is not a directory"};
  if (!read_only && ::access(p->dir.c_str(), W_OK) != 0)
    return {Code::kStorage, errno_message("storage path " + p->dir + " is not writable", errno)};
  Status s = open_file_checked(p, mode, read_only, files.gid);
  if (!s.ok()) return s;
  const int fd = p->fd;
  p->buffer_align = p->cached() ? 1 : direct_buffer_align(fd);
  if (read_only) return p->huge_page ? map_huge(p, 0, true) : Status::Ok();
  if (p->fresh && files.stamp) {
    // The layout's free-slot header first: a start killed while preallocating leaves a pool of ours.
    void* hdr = nullptr;
    if (::posix_memalign(&hdr, kAlign, g.header_bytes) != 0) return {Code::kCapacityExceeded, "out of memory"};
    encode_free_header(g, files.desc, static_cast<uint8_t*>(hdr));
    s = p->huge_page ? write_huge_head(p, hdr, g.header_bytes) : write_head(p, hdr, g.header_bytes);
    std::free(hdr);
    if (!s.ok()) return s;
  }
  // hugetlbfs: whole pages (fallocate rounds up anyway; the mapping must cover the file exactly).
  if (p->huge_page) bytes = (bytes + p->huge_page - 1) / p->huge_page * p->huge_page;
  // A larger existing file is left as it is (never truncated): its tail is simply not used.
  if (bytes > 0) {
    // Before fallocate: dirty pages of an existing file get their blocks as written data (see
    // write_unwritten).
    if (prewrite && p->direct && !p->memory && ::fdatasync(fd) != 0)
      return {Code::kStorage, errno_message("fdatasync " + p->file, errno)};
    int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc == ENOSPC)
      return {Code::kCapacityExceeded, "no space left on " + p->dir + " to preallocate " + std::to_string(bytes) + " bytes" +
                                           (p->huge_page ? " (hugetlbfs: free huge pages, /proc/sys/vm/nr_hugepages)" : "")};
    if (rc != 0) return {Code::kStorage, errno_message("fallocate " + p->file, rc)};
    if (prewrite && p->direct && !p->memory) return write_unwritten(*p, bytes);
  }
  return p->huge_page ? map_huge(p, bytes, false) : Status::Ok();
}

// Touches every page of new pool files on memory file systems once, writing, so that the first
// store into them runs as fast as later ones. fallocate reserves tmpfs pages but leaves them to be
// cleared on first use, and under a hypervisor the guest's first touch of memory is slower still:
// on the H200 host the first store into a new pool ran at 8-15 GB/s, later ones at 28-37
// (docs/perf/2026-11-30-h200-cuda-afternoon.md, "The first pass over a new pool"). Best effort: without MADV_POPULATE_WRITE (Linux < 5.14) the
// first store pays it.
static void touch_memory_files(const std::vector<PoolPath*>& files, uint64_t slot_bytes) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < files.size();) {
      const uint64_t bytes = static_cast<uint64_t>(files[i]->num_slots) * slot_bytes;
      void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, files[i]->fd, 0);
      if (m == MAP_FAILED) continue;
      ::madvise(m, bytes, MADV_POPULATE_WRITE);
      ::munmap(m, bytes);
    }
  };
  std::vector<std::thread> threads(std::min<size_t>(files.size(), 8) - 1);
  for (std::thread& t : threads) t = std::thread(work);
  work();
  for (std::thread& t : threads) t.join();
}

// The page size of a hugetlbfs directory, else 0.
static uint64_t huge_page_of(const std::string& dir) {
  struct statfs sfs;
  return statfs(dir.c_str(), &sfs) == 0 && sfs.f_type == HUGETLBFS_MAGIC ? static_cast<uint64_t>(sfs.f_bsize) : 0;
}

static bool memory_fs(const std::string& dir) {
  struct statfs sfs;
  return statfs(dir.c_str(), &sfs) == 0 &&
         (sfs.f_type == TMPFS_MAGIC || sfs.f_type == RAMFS_MAGIC || sfs.f_type == HUGETLBFS_MAGIC);
}

static std::string pool_file_name(const std::string& dir, const std::string& instance, uint32_t k) {
  return dir + "/tutti-" + instance + (k == 0 ? "" : "." + std::to_string(k)) + ".pool";
}

Status FilePool::open(const std::vector<std::string>& dirs, const std::vector<uint64_t>& capacity,
                      const std::string& instance, const Geometry& g, DirectMode mode, bool read_only,
                      uint32_t files_per_path, bool prewrite, const PoolFileOptions& pool_files,
                      const std::vector<Tier>& tiers) {
  if (dirs.empty()) return {Code::kConfig, "no storage paths configured"};
  if (capacity.size() != dirs.size()) return {Code::kConfig, "one capacity per storage path is required"};
  if (!tiers.empty() && tiers.size() != dirs.size()) return {Code::kConfig, "one tier per storage path is required"};
  auto tier_of_dir = [&](size_t d) { return tiers.empty() ? Tier::kStorage : tiers[d]; };
  for (size_t d = 0; d < dirs.size(); ++d) {
    if (tier_of_dir(d) == Tier::kMemory && !memory_fs(dirs[d]))
      return {Code::kConfig, "memory tier path " + dirs[d] + " is not on a memory file system (tmpfs, ramfs or hugetlbfs)"};
    for (size_t e = 0; e < d; ++e)
      if (dirs[e] == dirs[d]) return {Code::kConfig, "path " + dirs[d] + " is named twice (a storage and a memory path?)"};
  }
  if (instance.empty() || instance.find('/') != std::string::npos)
    return {Code::kConfig, "instance name must be non-empty and contain no '/'"};
  slot_bytes_ = g.slot_bytes;
  num_slots_ = 0;
  tier_slots_[0] = tier_slots_[1] = 0;
  // Files per path: as configured, or (read-only) as many as exist.
  std::vector<uint32_t> files(dirs.size());
  for (size_t d = 0; d < dirs.size(); ++d) {
    // Memory file systems: 16 files (each write holds its file's inode lock, and io_uring's workers
    // run one write per file at a time), but never less than one GPU file each.
    uint32_t n = files_per_path;
    if (n == 0)
      n = memory_fs(dirs[d]) ? static_cast<uint32_t>(std::clamp<uint64_t>(capacity[d] / g.slot_bytes, 1, 16)) : 1;
    if (read_only) {
      struct stat st;  // lstat: a symbolic link at a pool's name is counted, to be refused by name
      n = 0;
      while (::lstat(pool_file_name(dirs[d], instance, n).c_str(), &st) == 0) ++n;
      if (n == 0) return {Code::kNotFound, "no pool file " + pool_file_name(dirs[d], instance, 0)};
    }
    files[d] = n;
  }
  const uint32_t max_files = *std::max_element(files.begin(), files.end());
  paths_.clear();
  for (uint32_t k = 0; k < max_files; ++k)
    for (uint32_t d = 0; d < dirs.size(); ++d) {
      if (k >= files[d]) continue;
      PoolPath p;
      p.dir = dirs[d];
      p.dir_index = d;
      p.file = pool_file_name(dirs[d], instance, k);
      // Whole GPU files, spread over the path's files (the first ones take one more where they do
      // not divide evenly): a path's capacity holds as many slots whatever its number of files.
      const uint64_t slots = capacity[d] / g.slot_bytes;
      p.capacity = (slots / files[d] + (k < slots % files[d] ? 1 : 0)) * g.slot_bytes;
      p.memory = memory_fs(dirs[d]);
      p.huge_page = huge_page_of(dirs[d]);
      p.tier = tier_of_dir(d);
      paths_.push_back(p);
    }
  free_.assign(paths_.size(), {});
  // On failure, remove the files this open made and give back the space of files it preallocated
  // from empty (best effort); files that held data stay as they are.
  auto fail = [this](Status s) {
    for (PoolPath& q : paths_) {
      if (q.fd < 0) continue;
      struct stat mine, named;
      if (q.created) {
        // Only while the name still is this file (never another one put there since).
        if (::fstat(q.fd, &mine) == 0 && ::lstat(q.file.c_str(), &named) == 0 && mine.st_dev == named.st_dev &&
            mine.st_ino == named.st_ino)
          ::unlink(q.file.c_str());
      } else if (q.fresh) {
        int rc = ::ftruncate(q.fd, 0);
        (void)rc;
      }
    }
    close();
    return s;
  };
  for (PoolPath& p : paths_) {
    uint64_t n = p.capacity / g.slot_bytes;
    if (n == 0 && !read_only) {
      return fail({Code::kConfig, "capacity of " + p.dir + " (" + std::to_string(capacity[p.dir_index]) + " bytes over " +
                                 std::to_string(files[p.dir_index]) + " file(s)) is below one GPU file (" +
                                 std::to_string(g.slot_bytes) + " bytes)"});
    }
    Status s = open_one(&p, read_only ? 0 : n * g.slot_bytes, mode, read_only, prewrite, pool_files, g);
    if (!s.ok()) return fail(s);
    if (read_only) {
      struct stat st;
      if (::fstat(p.fd, &st) != 0) return fail({Code::kStorage, errno_message("stat " + p.file, errno)});
      n = static_cast<uint64_t>(st.st_size) / g.slot_bytes;
    }
    p.first_slot = num_slots_;
    p.num_slots = static_cast<uint32_t>(n);
    num_slots_ += p.num_slots;
    tier_slots_[static_cast<int>(p.tier)] += p.num_slots;
  }
  std::vector<PoolPath*> fresh_memory;
  for (PoolPath& p : paths_)
    if (prewrite && !read_only && p.memory && !p.huge_page && p.fresh) fresh_memory.push_back(&p);  // hugetlbfs: fallocate allocated
  if (!fresh_memory.empty()) touch_memory_files(fresh_memory, g.slot_bytes);
  slot_path_.resize(num_slots_);
  for (uint32_t i = 0; i < paths_.size(); ++i) {
    for (uint32_t s = 0; s < paths_[i].num_slots; ++s) slot_path_[paths_[i].first_slot + s] = i;
    // Highest index at the back so low slots are used first.
    for (uint32_t s = paths_[i].num_slots; s-- > 0;) free_[i].push_back(paths_[i].first_slot + s);
  }
  return Status::Ok();
}

Status FilePool::map_memory_files() {
  for (PoolPath& p : paths_) {
    // With a memory tier, only its files: storage paths on tmpfs (a stand-in for NVMe) keep io_uring.
    if (!p.memory || p.map || p.num_slots == 0 || (has_memory_tier() && p.tier != Tier::kMemory)) continue;
    const uint64_t bytes = static_cast<uint64_t>(p.num_slots) * slot_bytes_;
    void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, p.fd, 0);
    if (m == MAP_FAILED) return {Code::kStorage, errno_message("mmap " + p.file, errno)};
    p.map = static_cast<uint8_t*>(m);
    p.map_bytes = bytes;
  }
  return Status::Ok();
}

bool FilePool::alloc(uint32_t* slot, Tier t) {
  std::lock_guard<std::mutex> g(mu_);
  uint32_t& next = next_path_[static_cast<int>(t)];
  for (size_t tries = 0; tries < paths_.size(); ++tries) {
    uint32_t p = next;
    next = (next + 1) % paths_.size();
    if (paths_[p].tier == t && !free_[p].empty()) {
      *slot = free_[p].back();
      free_[p].pop_back();
      return true;
    }
  }
  return false;
}

void FilePool::release(uint32_t slot) {
  std::lock_guard<std::mutex> g(mu_);
  free_[slot_path_[slot]].push_back(slot);
}

void FilePool::set_used(const std::vector<uint8_t>& used) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& f : free_) f.clear();
  for (uint32_t slot = num_slots_; slot-- > 0;)  // highest at the back: low slots are used first
    if (!used[slot]) free_[slot_path_[slot]].push_back(slot);
}

uint32_t FilePool::free_slots() const { return free_slots(Tier::kStorage) + free_slots(Tier::kMemory); }

uint32_t FilePool::free_slots(Tier t) const {
  std::lock_guard<std::mutex> g(mu_);
  uint32_t n = 0;
  for (size_t p = 0; p < paths_.size(); ++p)
    if (paths_[p].tier == t) n += static_cast<uint32_t>(free_[p].size());
  return n;
}

// hugetlbfs: a copy through the file's mapping (bounded by it).
static Status huge_copy(const PoolPath& p, uint64_t at, void* buf, const void* src, uint64_t n) {
  if (!p.map || at > p.map_bytes || n > p.map_bytes - at)
    return {Code::kStorage, "bytes " + std::to_string(at) + "+" + std::to_string(n) + " lie beyond the mapping of " + p.file};
  if (src) std::memcpy(p.map + at, src, n);
  else std::memcpy(buf, p.map + at, n);
  return Status::Ok();
}

Status FilePool::pread_all(uint32_t slot, uint64_t off, void* buf, uint64_t n) const {
  const PoolPath& p = paths_[slot_path_[slot]];
  uint64_t base = offset_of(slot) + off, done = 0;
  if (p.huge_page) return huge_copy(p, base, buf, nullptr, n);
  while (done < n) {
    ssize_t r = ::pread(p.fd, static_cast<uint8_t*>(buf) + done, n - done, static_cast<off_t>(base + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return {Code::kStorage, errno_message("read " + p.file, errno)};
    if (r == 0) return {Code::kStorage, "short read from " + p.file};
    done += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

Status FilePool::pwrite_all(uint32_t slot, uint64_t off, const void* buf, uint64_t n) const {
  const PoolPath& p = paths_[slot_path_[slot]];
  uint64_t base = offset_of(slot) + off, done = 0;
  if (p.huge_page) return huge_copy(p, base, nullptr, buf, n);
  while (done < n) {
    ssize_t r = ::pwrite(p.fd, static_cast<const uint8_t*>(buf) + done, n - done, static_cast<off_t>(base + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return {Code::kStorage, errno_message("write " + p.file, errno)};
    done += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

void FilePool::write_slot_heads(const uint32_t* slots, const uint8_t* bufs, uint64_t bytes, uint32_t n,
                                uint8_t* ok) const {
  constexpr uint32_t kDepth = 64;
  std::fill(ok, ok + n, 0);
  std::lock_guard<std::mutex> g(ring_mu_);
  if (!ring_ && !ring_failed_) {
    ring_ = new io_uring;
    if (io_uring_queue_init(kDepth, ring_, 0) != 0) {
      delete ring_;
      ring_ = nullptr;
      ring_failed_ = true;  // seccomp or an old kernel: synchronous writes from now on
    }
  }
  std::vector<uint32_t> by_ring;  // hugetlbfs files take no write: their copies are made below
  for (uint32_t k = 0; k < n; ++k)
    if (!paths_[slot_path_[slots[k]]].huge_page) by_ring.push_back(k);
  for (uint32_t i = 0; ring_ && i < by_ring.size(); i += kDepth) {
    const uint32_t batch = std::min(static_cast<uint32_t>(by_ring.size()) - i, kDepth);
    for (uint32_t j = i; j < i + batch; ++j) {
      const uint32_t k = by_ring[j];
      io_uring_sqe* e = io_uring_get_sqe(ring_);
      io_uring_prep_write(e, paths_[slot_path_[slots[k]]].fd, bufs + k * bytes, static_cast<unsigned>(bytes),
                          offset_of(slots[k]));
      io_uring_sqe_set_data(e, reinterpret_cast<void*>(static_cast<uintptr_t>(k)));
    }
    const int submitted = io_uring_submit_and_wait(ring_, batch);
    int reaped = 0;
    while (reaped < submitted) {
      io_uring_cqe* c = nullptr;
      const int rc = io_uring_wait_cqe(ring_, &c);
      if (rc == -EINTR) continue;
      if (rc < 0) break;
      ok[reinterpret_cast<uintptr_t>(io_uring_cqe_get_data(c))] = c->res == static_cast<int>(bytes);
      io_uring_cqe_seen(ring_, c);
      ++reaped;
    }
    if (submitted != static_cast<int>(batch) || reaped != submitted) {
      // The ring misbehaved: drop it and write what is left synchronously. A write still in flight
      // can only land these bytes, or torn ones whose header CRC fails (a miss, never wrong KV).
      io_uring_queue_exit(ring_);
      delete ring_;
      ring_ = nullptr;
      ring_failed_ = true;
    }
  }
  for (uint32_t k = 0; k < n; ++k)
    if (!ok[k]) ok[k] = pwrite_all(slots[k], 0, bufs + k * bytes, bytes).ok();
}

}  // namespace tutti
