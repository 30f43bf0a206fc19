// The store's options and statistics (engine API), shared by the unit store and the engine session.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tutti {

// O_DIRECT on the pool files: where the file system takes it (kAuto), required, or never.
enum class DirectMode : int { kAuto = 0, kOn = 1, kOff = 2 };

// The tier a pool file serves: the storage tier (SSDs) or the memory tier in front of it.
enum class Tier : uint8_t { kStorage = 0, kMemory = 1 };

// Where a store lands and when it reaches the storage tier (StoreOptions::write_policy).
//   kWriteBack: into the memory tier; a background flusher copies it to the storage tier.
//   kWriteThrough: into the memory tier, and `finish` returns once the storage copy is committed.
//   kMemoryOnly: into the memory tier only (the storage tier is still read, and promoted from).
enum class WritePolicy : int { kWriteBack = 0, kWriteThrough = 1, kMemoryOnly = 2 };

// Remote units in flight at once per store (Store::scatter_unit_async).
constexpr uint32_t kScatterSlots = 4;

// The one definition of these defaults: TuttiConfig (tutti_cluster/config.py) reads the defaults of the
// fields it shares by name (every field but paths, capacity, unit_blocks, io_workers, backend,
// read_only and file_gid) from StoreOptions(), and the Python side sets every field from the configuration.
struct StoreOptions {
  std::vector<std::string> paths;
  std::vector<uint64_t> capacity;  // bytes per path
  // The memory tier in front of `paths` (the storage tier): tmpfs or ramfs directories and their
  // bytes. Empty: one tier, today's store. A unit is read from its fastest copy.
  std::vector<std::string> memory_paths;
  std::vector<uint64_t> memory_capacity;
  WritePolicy write_policy = WritePolicy::kWriteBack;
  // A unit read from the storage tier is copied into the memory tier on its promote_hits-th hit
  // within promote_window_s seconds (0: never), so one long scan does not flush the hot set.
  uint32_t promote_hits = 2;
  double promote_window_s = 60.0;
  std::string instance = "default";
  uint32_t pool_files = 0;         // pool files per path; 0: up to 16 on memory file systems, 1 elsewhere
  bool prewrite_pool = true;       // zero what fallocate left unwritten, once (see FilePool::open)
  uint32_t unit_blocks = 16;
  uint32_t queue_depth = 64;       // io_uring depth of the agent
  uint64_t staging_mb = 128;       // pinned staging area in MiB
  uint32_t max_requests = 256;     // requests in flight
  uint32_t io_workers = 1;         // kernel workers (thread blocks / host scatter threads)
  uint32_t io_sms = 8;
  uint64_t min_io_bytes = 256 << 10;
  DirectMode direct_io = DirectMode::kAuto;
  std::string backend = "cpu";     // "cpu" or "cuda"
  int device = 0;
  bool cuda_pair = false;          // CUDA: K and V of a unit-layer as one I/O (slower on the H200 host)
  bool cuda_trace = false;         // CUDA: print the I/O kernel's counters when the store closes
  // CUDA: device memory (MiB, two buffers taken in turn) where the copy engine stages a layer's
  // objects of mapped pool files (the memory tier) before the I/O kernel verifies and scatters them;
  // objects past its room, or all with 0 (the default), the kernel loads over PCIe itself.
  // Allocated only when a pool file is mapped. See docs/CUDA.md, "The memory tier's path to the GPU".
  uint64_t copy_engine_mb = 0;
  bool read_only = false;          // open existing pools for reading only (no agent)
  // Map the pool files on memory file systems and move their objects with loads and stores
  // instead of io_uring (byte-addressable storage); files elsewhere still go through the agent.
  bool map_memory_paths = true;
  // Group of the pool files (mode 0640), or -1: owner only (0600). See PoolFileOptions.
  int64_t file_gid = -1;
};

struct StoreStats {
  uint64_t units = 0, pinned = 0, free_slots = 0, total_slots = 0;
  uint64_t hits = 0, lookups = 0, evictions = 0, checksum_failures = 0, io_errors = 0;
  // The memory tier (zero without one): units with a copy there, its slots, lookup hits whose
  // fastest copy is there or only on storage, bytes retrieves read from it (bytes_read counts both),
  // storage copies taken into it (promotions) and memory copies dropped for room (demotions), units
  // copied to storage (flushes, flush_bytes), copies that failed, and units in memory only.
  uint64_t memory_units = 0, memory_slots = 0, memory_free_slots = 0, memory_hits = 0, storage_hits = 0;
  uint64_t memory_bytes_read = 0, promotions = 0, demotions = 0, flushes = 0, flush_bytes = 0, flush_errors = 0;
  uint64_t flush_backlog = 0;
  uint64_t bad_headers = 0;  // slots whose header did not verify when the index was (re)built
  uint64_t bytes_read = 0, bytes_written = 0, agent_ops = 0;
  double agent_cpu_s = 0, kernel_cpu_s = 0;
  uint64_t direct_ios = 0;  // I/Os straight between a pool file and the KV blocks, no staging copy
  uint64_t copy_engine_bytes = 0;  // bytes of mapped objects the copy engine staged for retrieves (CUDA)
  // Extent map: per-layer descriptors plus the largest request's extents and IOCTXs so far.
  uint64_t extent_map_bytes = 0, request_map_peak_bytes = 0, staging_bytes = 0, slot_bytes = 0, obj_bytes = 0;
  bool direct_io = false, fixed_buffers = false;
  uint32_t mapped_files = 0;  // pool files the I/O kernel moves with loads and stores (map_memory)
  std::string backend;
};

}  // namespace tutti
