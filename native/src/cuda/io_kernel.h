// The CUDA backend's kernels as its host side sees them: their constants, parameter blocks and
// declarations. The kernels are defined in io_kernel.cu; the host side is cuda_backend.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend.h"
#include "tutti/crc32c.h"

namespace tutti {
namespace gpu {

// Staging slots of I/O in use at most, in queue depths (each slot waits for its worker warp too).
// 3 or 4 were no better (docs/perf/2026-12-01-crc32c-ab.md, "What was tried on the way").
constexpr uint32_t kWindowQd = 2;
constexpr uint32_t kMaxLaunchIocbs = 8;
// Launches alternate between two I/O streams ("lanes"), each with its own SQ/CQ pairs and half of
// the staging chunks, so that the kernel of the next layer gathers (store) or posts its reads while
// the last I/Os of the previous layer's kernel drain. Two blocks fit on an SM (64 registers).
constexpr uint32_t kLanes = 2;
constexpr uint32_t kWorkerWarps = 15;
constexpr uint32_t kThreads = 32 * (1 + kWorkerWarps);
constexpr uint32_t kMaxChunksPerWorker = 8192;  // 14-bit chunk index in the packed entries
// A mapped object a retrieve reads whole is cut into this many pieces, each a work entry of its own
// (the piece in bits 30-31 of the entry), so that a layer's objects spread over more worker warps:
// at 16K tokens a layer holds 16 objects per block for 15 worker warps, and one warp would move a
// second object alone. Each piece sums its bytes alone; the last to finish joins the sums (one shift
// each, crc32c.h) and checks the object.
constexpr uint32_t kPieces = 4;

struct DevQueue {
  RingCtl* sq_ctl;
  Sqe* sq;
  RingCtl* cq_ctl;
  Cqe* cq;
  uint64_t depth;
};

struct LaunchIocb {
  uint32_t id, op, layer, ctx_first, ctx_count, pad;
  uint64_t issue_seq;
  const Ioctx* ctx;        // device
  const Extent* extents;   // device
  const uint64_t* expect;  // device, [unit][obj]: expected checksums (retrieve)
  uint8_t* failed;         // device, [unit]
  uint8_t* failed_out;     // mapped host, [unit]
  uint64_t* sums_out;      // mapped host, [unit][obj]: checksums made by a store
  uint32_t* pieces;        // device, [unit][obj][2]: a split object's joined sums, pieces done (zeroed per request)
  uint64_t kv[2];          // the layer's object base pointers
  uint64_t block_stride;
  // Retrieve: the copy engine staged the layer's objects of slots [copy_lo, copy_hi) (copy_stage.h)
  // at copy_base before the launch; the kernel reads them there instead of from their mapping.
  const uint32_t* copy_slot;  // device, [unit]: the unit's slot, or kNoCopy
  uint8_t* copy_base;         // device: slot copy_lo's objects of this layer, then the next slot's
  uint32_t copy_lo, copy_hi;
};

struct LaunchParams {
  uint32_t n;
  uint32_t chunks_per_worker;
  uint32_t unit_blocks, objs_per_layer, num_objs, vec16;
  uint32_t group;  // IOCTXs per staging slot: 2 when K and V of a unit-layer may move as one I/O
  uint32_t queue0; // the lane's first SQ/CQ pair: block b uses pair queue0 + b and its chunk share
  uint32_t window; // staging slots of I/O (not mapped objects) a block keeps in use at most
  uint64_t block_bytes, obj_bytes, header_bytes, chunk_bytes;
  uint8_t* staging;       // device view of the staging region
  const DevQueue* queues; // device array, one per block of each lane
  Iocb* iocbs;            // device view of the IOCB table
  uint32_t* counters;     // device, [iocb][2]: blocks finished, errors
  const uint64_t* abort;  // mapped host word, set by stop()
  unsigned long long* trace;  // device, [4]: worker busy ns, manager idle ns, block ns, objects
  const uint64_t* mapped;     // device, per pool file: device address of its mapping or 0; null: none
  const CrcLaneTables* crc;   // device: the lane scheme's tables (crc32c.h)
  uint32_t crc_xor;           // raw register -> CRC32C of one object (crc32c_zeros_xor(obj_bytes))
  uint32_t pieces;            // pieces per mapped object a retrieve reads whole: kPieces, or 1 (no split)
  uint32_t piece_shift[kPieces];  // x^(8 k piece_bytes) mod P: joins piece kPieces - 1 - k's sum
  LaunchIocb b[kMaxLaunchIocbs];
};

// ---- device helpers ---------------------------------------------------------------------------

// The remote path: one unit in mapped host memory (a GPU file, header first) scattered into the KV
// blocks, each object verified on the same pass. One warp per object.
struct ScatterParams {
  const uint8_t* unit;      // device view of the unit (mapped host memory)
  const uint64_t* dst;      // device, [obj][unit block]: block addresses
  const uint64_t* expect;   // device, [obj]: CRC32C from the unit's header
  uint8_t* bad;             // mapped host, [obj]: 1 when the object fails
  uint32_t num_objs, unit_blocks, vec16, crc_xor;
  uint64_t block_bytes, obj_bytes, header_bytes;
  const CrcLaneTables* crc;
};
constexpr uint32_t kScatterWarps = 8;

__global__ void io_kernel(const __grid_constant__ LaunchParams p);
__global__ void scatter_kernel(const __grid_constant__ ScatterParams p);

}  // namespace gpu
}  // namespace tutti
