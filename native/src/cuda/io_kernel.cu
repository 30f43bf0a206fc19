// The device side of the CUDA backend: the I/O kernel and the remote path's scatter kernel
// (their constants and parameter blocks: io_kernel.h).
//
// Data path (retrieve): the engine thread launches one kernel per layer on one of two I/O streams
// (lanes, taken in turn; each after the caller's event), so that consecutive layers overlap. Each
// thread block owns one SQ/CQ pair of its lane and a fixed share of the staging chunks.
// Warp 0, lane 0 of the block is the queue manager: it turns the block's IOCTXs into SQEs, polls
// the CQ, and hands completed chunks to the worker warps through shared memory. A worker warp reads
// the object straight from mapped pinned memory, sums its checksum and writes the KV blocks in one
// pass; a mismatch marks the unit failed (a miss). Store runs the other way: workers gather the
// blocks into staging and checksum them, then the manager posts the write.
//
// Memory ordering on mapped memory (the H200 reports hostNativeAtomicSupported = 0): every ring
// word has one writer; the GPU publishes with system-scope release stores and reads host-written
// words with system-scope acquire loads; no read-modify-write atomic ever touches host memory.
// Cross-block accounting (which block finishes an IOCB last) uses device-memory atomics only.
#include <cuda/atomic>

#include "io_kernel.h"

namespace tutti {
namespace gpu {

namespace {

// Vectors in flight per lane of a warp's move; 3 (no register spills) was slower
// (docs/perf/2026-12-01-crc32c-ab.md, "What was tried on the way").
constexpr uint32_t kIoUnroll = 4;
constexpr uint32_t kValid = 1u << 31;
constexpr uint32_t kPost = 1u << 30;

// Packed work entry: IOCTX offset inside its IOCB (12 bits), IOCB index inside the launch (4 bits),
// chunk index inside the block's share (14 bits).
__host__ __device__ inline uint32_t pack(uint32_t off, uint32_t k, uint32_t chunk) { return off | (k << 12) | (chunk << 16); }
__device__ inline uint32_t ent_off(uint32_t e) { return e & 0xfff; }
__device__ inline uint32_t ent_k(uint32_t e) { return (e >> 12) & 0xf; }
__device__ inline uint32_t ent_chunk(uint32_t e) { return (e >> 16) & 0x3fff; }

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*const_cast<uint64_t*>(p)).load(cuda::memory_order_acquire);
}
__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*p).store(v, cuda::memory_order_release);
}
template <typename T>
__device__ __forceinline__ T vload(const T* p) {
  return *const_cast<const volatile T*>(p);
}
template <typename T>
__device__ __forceinline__ void vstore(T* p, T v) {
  *const_cast<volatile T*>(p) = v;
}

// The checksum is CRC32C by the lane scheme of crc32c.h: lane l of the warp owns the object's
// vectors (16-byte path) or words (4-byte path) whose index is l mod 32, whatever block they sit in,
// and keeps a raw register over them in `acc`. `obj_off` is the object offset of `src`/`dst`.
// Loaded from LaunchParams::crc when a block starts; every worker warp looks its bytes up here, in
// nibble rows (crc32c.h: no bank conflicts, twice the lookups; byte rows were slower, e.g. the
// mapped 16K retrieve: docs/perf/2026-12-01-crc32c-ab.md, "Nibble rows for the GPU CRC").
constexpr uint32_t kCrcCols = 16;
__shared__ uint32_t crc_t[2 * kCrcRows][kCrcCols];  // 3 KiB
using CrcRows = const uint32_t (*)[kCrcCols];
__shared__ uint32_t crc_shift[64];         // lane_shift16, then lane_shift4

// One warp moves `bytes` from `src` to `dst` (when kCopy) and extends the lanes' CRC registers over
// them. kFromHost: `src` is mapped host memory that the host rewrites between uses, read with
// ld.global.cv so that no stale cached line is ever used.
template <bool kCopy, bool kFromHost, bool kCrc = true>
__device__ __forceinline__ void warp_move16(const uint8_t* src, uint8_t* dst, uint64_t bytes, uint64_t obj_off, CrcRows t,
                                            uint32_t& acc, uint32_t lane) {
  constexpr uint32_t U = kIoUnroll;  // vectors in flight per lane; 64 registers: two blocks per SM
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint32_t nv = static_cast<uint32_t>(bytes / 16);
  // This lane's first vector here: the warp still covers 32 consecutive vectors per step.
  const uint32_t first = (lane - static_cast<uint32_t>(obj_off / 16)) & 31u;
  for (uint32_t base = 0; base < nv; base += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      const uint32_t i = base + u * 32 + first;
      if (i < nv) v[u] = kFromHost ? __ldcv(s + i) : __ldcg(s + i);
    }
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      const uint32_t i = base + u * 32 + first;
      if (i < nv) {
        if (kCopy) d[i] = v[u];
        if (kCrc) acc = crc_lane_step16(t, acc, v[u].x, v[u].y, v[u].z, v[u].w);
      }
    }
  }
}

// The same with 4-byte words, for objects or pointers that are not 16-byte aligned.
template <bool kCopy, bool kFromHost, bool kCrc = true>
__device__ __forceinline__ void warp_move4(const uint8_t* src, uint8_t* dst, uint64_t bytes, uint64_t obj_off, CrcRows t,
                                           uint32_t& acc, uint32_t lane) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  const uint32_t nw = static_cast<uint32_t>(bytes / 4);
  for (uint32_t i = (lane - static_cast<uint32_t>(obj_off / 4)) & 31u; i < nw; i += 32) {
    const uint32_t v = kFromHost ? __ldcv(s + i) : __ldcg(s + i);
    if (kCopy) d[i] = v;
    if (kCrc) acc = crc_lane_step4(t, acc, v);
  }
}

template <bool kCopy, bool kFromHost, bool kCrc = true>
__device__ __forceinline__ void warp_move(bool vec16, const uint8_t* src, uint8_t* dst, uint64_t bytes, uint64_t obj_off,
                                          CrcRows t, uint32_t& acc, uint32_t lane) {
  if (vec16) warp_move16<kCopy, kFromHost, kCrc>(src, dst, bytes, obj_off, t, acc, lane);
  else warp_move4<kCopy, kFromHost, kCrc>(src, dst, bytes, obj_off, t, acc, lane);
}

// The object's CRC32C from the lanes' registers (every lane gets it).
__device__ __forceinline__ uint32_t warp_crc(bool vec16, const uint32_t* lane_shift16, const uint32_t* lane_shift4,
                                             uint32_t acc, uint32_t crc_xor, uint32_t lane) {
  uint32_t y = crc32c_multmodp(vec16 ? lane_shift16[lane] : lane_shift4[lane], acc);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) y ^= __shfl_xor_sync(0xffffffffu, y, o);
  return y ^ crc_xor;
}

// Zeroes the padding of a staging object (store) and extends the lanes' registers over the zeros.
__device__ __forceinline__ void warp_zero(bool vec16, uint8_t* dst, uint64_t bytes, uint64_t obj_off, CrcRows t,
                                          uint32_t& acc, uint32_t lane) {
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (uint64_t i = lane; i < bytes / 4; i += 32) d[i] = 0;
  const uint32_t w = vec16 ? 16 : 4, n = static_cast<uint32_t>(bytes / w);
  for (uint32_t i = (lane - static_cast<uint32_t>(obj_off / w)) & 31u; i < n; i += 32)
    acc = vec16 ? crc_lane_skip16(t, acc) : crc_lane_skip4(t, acc);
}

// The object of IOCTX `x` in its mapped pool file (map_memory), or null when that file is not mapped.
// Mapped objects need no SQE: the workers move them between the file's pages and the KV blocks, or,
// where the copy engine staged them for this launch, between that device copy and the KV blocks.
__device__ __forceinline__ uint8_t* mapped_object(const LaunchParams& p, const LaunchIocb& B, const Ioctx& x) {
  const uint64_t base = p.mapped ? p.mapped[x.path] : 0;
  if (!base) return nullptr;
  if (B.copy_hi > B.copy_lo) {
    const uint32_t s = B.copy_slot[x.unit];
    if (s >= B.copy_lo && s < B.copy_hi)
      return B.copy_base + (static_cast<uint64_t>(s - B.copy_lo) * p.objs_per_layer + x.obj) * p.obj_bytes;
  }
  return reinterpret_cast<uint8_t*>(base + x.file_offset + p.header_bytes +
                                    (static_cast<uint64_t>(B.layer) * p.objs_per_layer + x.obj) * p.obj_bytes);
}

// Where IOCTX x's object sits in the request's [unit][obj] arrays (expected and written checksums).
__device__ __forceinline__ uint64_t object_at(const LaunchParams& p, const LaunchIocb& B, const Ioctx& x) {
  return static_cast<uint64_t>(x.unit) * p.num_objs + static_cast<uint64_t>(B.layer) * p.objs_per_layer + x.obj;
}

// A retrieved object whose CRC32C is not the one written is a miss: its unit is reported failed
// and never counts as a hit. One lane calls it.
__device__ __forceinline__ void check_object(const LaunchIocb& B, const Ioctx& x, uint64_t at, uint64_t sum,
                                             uint32_t* errors) {
  if (sum == B.expect[at]) return;
  vstore<uint8_t>(&B.failed[x.unit], 2);
  vstore<uint8_t>(&B.failed_out[x.unit], 2);
  atomicAdd(errors, 1u);
}

// The piece `piece` of a mapped object that a retrieve reads whole (p.pieces > 1): its blocks move
// and sum alone; the last piece to finish joins the pieces' sums, checks the object and releases it.
template <typename Release>
__device__ void process_piece(const LaunchParams& p, const LaunchIocb& B, const Ioctx& x, const uint8_t* m, uint32_t piece,
                              uint32_t lane, uint32_t* errors, Release release) {
  const uint64_t piece_bytes = p.obj_bytes / p.pieces, lo = piece * piece_bytes;
  uint32_t acc = 0;
  for (uint32_t e = 0; e < x.extent_count; ++e) {
    const Extent ext = B.extents[x.extent_first + e];
    for (uint32_t j = 0; j < ext.num_blocks; ++j) {
      const uint64_t o = (ext.unit_offset_blocks + j) * p.block_bytes;
      if (o < lo || o >= lo + piece_bytes) continue;
      uint8_t* kv = reinterpret_cast<uint8_t*>(B.kv[x.obj] + (ext.first_block + j) * B.block_stride);
      warp_move<true, true>(p.vec16, m + o, kv, p.block_bytes, o - lo, crc_t, acc, lane);
    }
  }
  // The piece's raw register, shifted past the pieces after it; xor joins them (crc32c.h).
  const uint32_t mine = crc32c_multmodp(p.piece_shift[p.pieces - 1 - piece],
                                        warp_crc(p.vec16, crc_shift, crc_shift + 32, acc, 0, lane));
  const uint64_t at = object_at(p, B, x);
  uint32_t last = 0;
  if (lane == 0) {
    atomicXor(&B.pieces[2 * at], mine);
    __threadfence();  // this piece's sum is in before it counts as done
    last = atomicAdd(&B.pieces[2 * at + 1], 1u) == p.pieces - 1;
    if (last) {
      __threadfence();
      check_object(B, x, at, atomicXor(&B.pieces[2 * at], 0u) ^ p.crc_xor, errors);
    }
  }
  if (!__shfl_sync(0xffffffffu, last, 0)) return;  // the last piece hands the object back
  __threadfence_system();
  __syncwarp();
  release();
}

// Retrieve: verify and scatter one object from staging (or its mapped file). Store: gather one
// object into staging (or its mapped file) and record its checksum. Runs on one warp; `release()`
// hands the object's staging chunk back to the manager (once, after the warp's last use of it).
// A mapped object a retrieve reads comes as p.pieces entries (`piece`), see process_piece.
template <typename Release>
__device__ void process_object(const LaunchParams& p, const LaunchIocb& B, uint32_t off, uint32_t piece, uint8_t* chunk,
                               uint32_t lane, uint32_t* errors, Release release) {
  CrcRows t = crc_t;
  const Ioctx x = B.ctx[B.ctx_first + off];
  const bool read = B.op == static_cast<uint32_t>(IoOp::kRead);
  uint8_t* m = mapped_object(p, B, x);
  if (m) chunk = m;
  // Bytes in KV blocks: the unit's blocks, fewer for a partial unit (whose other bytes are zeros on
  // store and only summed on retrieve, like alignment padding).
  uint64_t blocks = 0;
  bool skips = false;  // a retrieve's skipped blocks (kSkipBlock): summed from the chunk, written nowhere
  for (uint32_t e = 0; e < x.extent_count; ++e) {
    blocks += B.extents[x.extent_first + e].num_blocks;
    skips = skips || B.extents[x.extent_first + e].first_block == kSkipBlock;
  }
  const uint64_t payload = blocks * p.block_bytes;
  if (p.pieces > 1 && read && m) {  // the manager posted p.pieces entries for this object
    if (payload == p.obj_bytes && !skips) return process_piece(p, B, x, m, piece, lane, errors, release);
    if (piece != 0) return;  // a partial unit, or skipped blocks: the first piece moves it whole
  }
  // A retrieve from staging copies first and hands the chunk back, then sums the blocks it wrote
  // (device memory, its own writes): the chunk's next I/O does not wait for the checksum, which
  // costs table lookups per byte. The unit is still failed, a miss, when the sum does not match.
  const bool early = read && !m && payload == p.obj_bytes && !skips;
  uint32_t acc = 0;
  for (uint32_t e = 0; e < x.extent_count; ++e) {
    const Extent ext = B.extents[x.extent_first + e];
    for (uint32_t j = 0; j < ext.num_blocks; ++j) {
      const uint64_t ub = ext.unit_offset_blocks + j;
      uint8_t* st = chunk + ub * p.block_bytes;
      const uint64_t o = ub * p.block_bytes;
      if (ext.first_block == kSkipBlock) {
        warp_move<false, true>(p.vec16, st, nullptr, p.block_bytes, o, t, acc, lane);
        continue;
      }
      uint8_t* kv = reinterpret_cast<uint8_t*>(B.kv[x.obj] + (ext.first_block + j) * B.block_stride);
      if (early) warp_move<true, true, false>(p.vec16, st, kv, p.block_bytes, o, t, acc, lane);
      else if (read) warp_move<true, true>(p.vec16, st, kv, p.block_bytes, o, t, acc, lane);
      else warp_move<true, false>(p.vec16, kv, st, p.block_bytes, o, t, acc, lane);
    }
  }
  if (early) {
    __syncwarp();  // every lane's loads from the chunk have returned (their stores used them)
    release();
    for (uint32_t e = 0; e < x.extent_count; ++e) {
      const Extent ext = B.extents[x.extent_first + e];
      for (uint32_t j = 0; j < ext.num_blocks; ++j) {
        const uint64_t o = (ext.unit_offset_blocks + j) * p.block_bytes;
        // Each lane reads back the vectors it wrote itself (the same lane ownership).
        const uint8_t* kv = reinterpret_cast<const uint8_t*>(B.kv[x.obj] + (ext.first_block + j) * B.block_stride);
        warp_move<false, false>(p.vec16, kv, nullptr, p.block_bytes, o, t, acc, lane);
      }
    }
  } else if (payload < p.obj_bytes) {
    if (read) warp_move<false, true>(p.vec16, chunk + payload, nullptr, p.obj_bytes - payload, payload, t, acc, lane);
    else warp_zero(p.vec16, chunk + payload, p.obj_bytes - payload, payload, t, acc, lane);
  }
  const uint64_t sum = warp_crc(p.vec16, crc_shift, crc_shift + 32, acc, p.crc_xor, lane);
  const uint64_t at = object_at(p, B, x);
  if (lane == 0) {
    if (read) check_object(B, x, at, sum, errors);
    else vstore<uint64_t>(&B.sums_out[at], sum);
  }
  // Staging writes (store) and result words must reach the host before the chunk is handed on.
  __threadfence_system();
  __syncwarp();
  if (!early) release();
}

// Copies the lane scheme's tables into shared memory (every thread of the block takes part; the
// caller synchronises the block before any lookup).
__device__ __forceinline__ void load_crc_tables(const CrcLaneTables* crc, uint32_t tid) {
  for (uint32_t i = tid; i < 2 * kCrcRows * 16; i += blockDim.x) crc_t[i / 16][i % 16] = crc_nibble_entry(crc->t, i);
  if (tid < 32) {
    crc_shift[tid] = crc->lane_shift16[tid];
    crc_shift[32 + tid] = crc->lane_shift4[tid];
  }
}

}  // namespace

__global__ void __launch_bounds__(kThreads, kLanes) io_kernel(const __grid_constant__ LaunchParams p) {
  extern __shared__ uint32_t smem[];
  const uint32_t C = p.chunks_per_worker, R = C * p.pieces;
  uint32_t* ready = smem;             // [R] manager -> workers: an entry per chunk, or per piece of a mapped object
  uint32_t* freed = smem + R;         // [C] workers -> manager, kValid | kPost? | entry
  uint32_t* chunk_ent = smem + R + C; // [C] entry of the chunk's current IOCTX
  uint32_t* free_stack = smem + R + 2 * C;   // [C / group] free slots
  uint8_t* slot_state = reinterpret_cast<uint8_t*>(smem + R + 3 * C);  // [C / group]
  __shared__ uint32_t ready_head, ready_claim, freed_claim, all_done, io_slots;
  __shared__ uint32_t errors[kMaxLaunchIocbs];

  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned long long t_start = now_ns();
  load_crc_tables(p.crc, tid);
  for (uint32_t i = tid; i < C; i += blockDim.x) freed[i] = 0;
  if (tid < kMaxLaunchIocbs) errors[tid] = 0;
  if (tid == 0) ready_head = ready_claim = freed_claim = all_done = io_slots = 0;
  __syncthreads();

  const DevQueue q = p.queues[p.queue0 + blockIdx.x];
  const uint64_t chunk0 = static_cast<uint64_t>(p.queue0 + blockIdx.x) * C;
  auto chunk_ptr = [&](uint32_t c) { return p.staging + (chunk0 + c) * p.chunk_bytes; };

  if (warp == 0) {
    if (lane == 0) {
      // ---- queue manager ----
      // The block takes groups of G consecutive IOCTXs (G = 2: K and V of one unit and layer, which
      // are adjacent in the GPU file) and gives each group a slot of G adjacent staging chunks. When
      // both IOCTXs of a group need I/O and form such a pair, one SQE of 2 objects moves them (one
      // 1 MiB I/O for the Llama-3-8B shape); otherwise each IOCTX gets its own SQE and chunk.
      const uint32_t G = p.group;
      const uint32_t nslots = C / G;
      uint32_t total = 0;
      for (uint32_t k = 0; k < p.n; ++k) {
        const uint32_t cnt = p.b[k].ctx_count, ng = (cnt + G - 1) / G;
        if (ng <= blockIdx.x) continue;
        total += (ng - blockIdx.x + gridDim.x - 1) / gridDim.x * G;
        if ((ng - 1) % gridDim.x == blockIdx.x) total -= ng * G - cnt;  // the IOCB's last group is short
      }
      uint32_t nfree = nslots;
      for (uint32_t s = 0; s < nslots; ++s) free_stack[s] = s;
      uint64_t sq_head = vload(&q.sq_ctl->head);  // own word: the last kernel left it here
      uint64_t cq_tail = vload(&q.cq_ctl->tail);  // own word
      uint32_t fh = 0, done = 0, k = 0, grp = blockIdx.x, nap = 32;
      // SQEs posted whose CQEs have not come back. Only then does the manager read the CQ's head
      // and the abort word, both in host memory: with none in flight (mapped or staged objects,
      // gathers before a write) it polls shared memory alone, and no read of the block crosses
      // PCIe beside the copy engine's or the workers' own.
      uint32_t in_flight = 0;
      unsigned long long idle_ns = 0;
      auto groups = [&](uint32_t kk) { return (p.b[kk].ctx_count + G - 1) / G; };
      // Puts one SQE for `objs` objects starting at the IOCTX of chunk `c` (manager-owned words).
      auto post_sqe = [&](uint32_t c, uint32_t objs, IoOp op) {
        const uint32_t e = chunk_ent[c];
        const LaunchIocb& B = p.b[ent_k(e)];
        const Ioctx& x = B.ctx[B.ctx_first + ent_off(e)];
        Sqe* s = &q.sq[sq_head % q.depth];
        vstore<uint64_t>(&s->tag, static_cast<uint64_t>(c) | (static_cast<uint64_t>(objs) << 32));
        vstore<uint64_t>(&s->file_offset,
                         x.file_offset + p.header_bytes + (static_cast<uint64_t>(B.layer) * p.objs_per_layer + x.obj) * p.obj_bytes);
        vstore<uint64_t>(&s->buf_offset, (chunk0 + c) * p.chunk_bytes);
        vstore<uint64_t>(reinterpret_cast<uint64_t*>(&s->len), static_cast<uint64_t>(objs * p.obj_bytes) |
                                                                     (static_cast<uint64_t>(x.path) << 32) |
                                                                     (static_cast<uint64_t>(op) << 48));
        ++sq_head;
        ++in_flight;
      };
      // slot_state[s]: bits 0-1 chunks of the slot still in use, bits 2-3 gathers a paired store
      // still waits for, bit 4 paired, bit 5 its objects go through the agent (it counts towards
      // the window; mapped objects do not). Only this lane touches it.
      auto release = [&](uint32_t s, uint32_t n) {
        slot_state[s] = static_cast<uint8_t>(slot_state[s] - n);
        if ((slot_state[s] & 3u) != 0) return;
        free_stack[nfree++] = s;
        if (slot_state[s] & 32u) --io_slots;
      };
      while (k < p.n && grp >= groups(k)) ++k;
      while (done < total) {
        bool progress = false, posted = false;
        // (a) Chunks handed back by the workers: free, or (store) post its write.
        for (;;) {
          const uint32_t e = vload(&freed[fh % C]);
          if (!(e & kValid)) break;
          vstore<uint32_t>(&freed[fh % C], 0);
          ++fh;
          progress = true;
          const uint32_t c = ent_chunk(e), s = c / G;
          const LaunchIocb& B = p.b[ent_k(e)];
          if ((e & kPost) && !mapped_object(p, B, B.ctx[B.ctx_first + ent_off(e)])) {
            if (slot_state[s] & 16u) {
              slot_state[s] = static_cast<uint8_t>(slot_state[s] - 4u);
              if ((slot_state[s] & 12u) == 0) {
                post_sqe(s * G, 2, IoOp::kWrite);  // both objects gathered: one write
                posted = true;
              }
            } else {
              post_sqe(c, 1, IoOp::kWrite);
              posted = true;
            }
          } else {
            release(s, 1);
            ++done;
          }
        }
        // (b) Completions from the agent.
        const uint64_t h = in_flight ? load_acquire_sys(&q.cq_ctl->head) : cq_tail;
        if (h != cq_tail) {
          progress = true;
          for (; cq_tail < h; ++cq_tail, --in_flight) {
            const Cqe* ce = &q.cq[cq_tail % q.depth];
            const uint64_t tag = vload(&ce->tag);
            const uint32_t c = static_cast<uint32_t>(tag), objs = static_cast<uint32_t>(tag >> 32);
            const int64_t res = vload(&ce->res);
            const uint32_t e = chunk_ent[c];
            const LaunchIocb& B = p.b[ent_k(e)];
            const bool ok = res == static_cast<int64_t>(objs * p.obj_bytes);
            if (B.op == static_cast<uint32_t>(IoOp::kRead) && ok) {
              for (uint32_t i = 0; i < objs; ++i) ready[(ready_head + i) % R] = chunk_ent[c + i];
              __threadfence_block();
              vstore<uint32_t>(&ready_head, ready_head + objs);
              continue;
            }
            if (!ok) {
              const uint32_t unit = B.ctx[B.ctx_first + ent_off(e)].unit;
              vstore<uint8_t>(&B.failed[unit], 1);
              vstore<uint8_t>(&B.failed_out[unit], 1);
              atomicAdd(&errors[ent_k(e)], 1u);
            }
            release(c / G, objs);
            done += objs;
          }
          store_release_sys(&q.cq_ctl->tail, cq_tail);
        }
        // (c) New groups of IOCTXs while slots are free.
        while (nfree > 0 && io_slots < p.window && k < p.n) {
          const LaunchIocb& B = p.b[k];
          const uint32_t first = grp * G, ck = k;
          const uint32_t n = min(G, B.ctx_count - first);
          grp += gridDim.x;
          while (k < p.n && grp >= groups(k)) {
            ++k;
            grp = blockIdx.x;
          }
          progress = true;
          uint32_t need = 0;  // bit i: IOCTX first + i needs I/O
          for (uint32_t i = 0; i < n; ++i) {
            const Ioctx& x = B.ctx[B.ctx_first + first + i];
            if (x.slot == kNoSlot || vload(&B.failed[x.unit]) != 0) ++done;  // a missing or failed unit needs no I/O
            else need |= 1u << i;
          }
          if (need == 0) continue;
          const Ioctx* xs = B.ctx + B.ctx_first + first;
          const bool paired = need == 3u && xs[0].obj == 0 && xs[1].obj == 1 && xs[0].unit == xs[1].unit &&
                              !mapped_object(p, B, xs[0]);
          bool io = false;
          for (uint32_t i = 0; i < n; ++i) io = io || ((need >> i) & 1u && !mapped_object(p, B, xs[i]));
          io_slots += io;
          const uint32_t s = free_stack[--nfree];
          const bool read = B.op == static_cast<uint32_t>(IoOp::kRead);
          slot_state[s] = static_cast<uint8_t>(__popc(need) | (paired ? 16u | 8u : 0u) | (io ? 32u : 0u));
          for (uint32_t i = 0; i < n; ++i) {
            if (!(need & (1u << i))) continue;
            const uint32_t c = s * G + i;
            const uint32_t e = pack(first + i, ck, c);
            chunk_ent[c] = e;
            if (read && !mapped_object(p, B, xs[i])) {
              if (!paired) {
                post_sqe(c, 1, IoOp::kRead);
                posted = true;
              }
            } else {
              // Store: gather first, post after. Mapped: no I/O at all, and a retrieve's object in pieces.
              const uint32_t n = read ? p.pieces : 1;
              for (uint32_t q = 0; q < n; ++q) ready[(ready_head + q) % R] = e | (q << 30);
              __threadfence_block();
              vstore<uint32_t>(&ready_head, ready_head + n);
            }
          }
          if (read && paired) {
            post_sqe(s * G, 2, IoOp::kRead);
            posted = true;
          }
        }
        // The SQ holds more entries than the block has chunks, so a post never overruns it.
        if (posted) store_release_sys(&q.sq_ctl->head, sq_head);
        if (progress) {
          nap = 32;
        } else {
          if (in_flight && vload(p.abort) != 0) {
            for (uint32_t i = 0; i < p.n; ++i) atomicAdd(&errors[i], 1u);  // the store is closing: give up
            break;
          }
          __nanosleep(nap);
          idle_ns += nap;
          nap = min(nap * 2, 1024u);
        }
      }
      atomicAdd(&p.trace[1], idle_ns);
      __threadfence_block();
      vstore<uint32_t>(&all_done, 1);
    }
  } else {
    // ---- worker warps ----
    unsigned long long busy = 0, objs = 0;
    for (;;) {
      uint32_t idx = 0, have = 0, e = 0;
      if (lane == 0) {
        idx = atomicAdd(&ready_claim, 1u);
        uint32_t nap = 32;
        for (;;) {
          if (vload(&ready_head) > idx) {
            have = 1;
            break;
          }
          if (vload(&all_done)) break;
          __nanosleep(nap);
          nap = min(nap * 2, 256u);
        }
        if (have) {
          __threadfence_block();
          e = vload(&ready[idx % R]);
        }
      }
      have = __shfl_sync(0xffffffffu, have, 0);
      if (!have) break;
      e = __shfl_sync(0xffffffffu, e, 0);
      const uint32_t piece = e >> 30;
      e &= 0x3fffffffu;
      const uint32_t k = ent_k(e);
      const unsigned long long t0 = now_ns();
      auto release = [&] {
        if (lane == 0) {
          const uint32_t slot = atomicAdd(&freed_claim, 1u);
          const uint32_t post = p.b[k].op == static_cast<uint32_t>(IoOp::kRead) ? 0u : kPost;
          __threadfence_block();
          vstore<uint32_t>(&freed[slot % C], kValid | post | e);
        }
      };
      process_object(p, p.b[k], ent_off(e), piece, chunk_ptr(ent_chunk(e)), lane, &errors[k], release);
      busy += now_ns() - t0;
      ++objs;
    }
    if (lane == 0 && objs) {
      atomicAdd(&p.trace[0], busy);
      atomicAdd(&p.trace[3], objs);
    }
  }
  __syncthreads();
  if (tid == 0) {
    atomicAdd(&p.trace[2], now_ns() - t_start);
    // The block that finishes an IOCB last publishes its completion to the host.
    for (uint32_t k = 0; k < p.n; ++k) {
      const uint32_t id = p.b[k].id;
      if (errors[k]) atomicAdd(&p.counters[2 * id + 1], errors[k]);
      __threadfence_system();
      if (atomicAdd(&p.counters[2 * id], 1u) == gridDim.x - 1) {
        __threadfence();
        const uint32_t errs = atomicExch(&p.counters[2 * id + 1], 0u);
        p.counters[2 * id] = 0;
        vstore<uint64_t>(&p.iocbs[id].errors, errs);
        __threadfence_system();
        store_release_sys(&p.iocbs[id].done_seq, p.b[k].issue_seq);
      }
    }
  }
}

__global__ void __launch_bounds__(32 * kScatterWarps) scatter_kernel(const __grid_constant__ ScatterParams p) {
  const uint32_t tid = threadIdx.x, lane = tid & 31;
  load_crc_tables(p.crc, tid);
  __syncthreads();
  const uint32_t o = blockIdx.x * kScatterWarps + (tid >> 5);
  if (o >= p.num_objs) return;
  CrcRows t = crc_t;
  const uint8_t* src = p.unit + p.header_bytes + static_cast<uint64_t>(o) * p.obj_bytes;
  const uint64_t payload = static_cast<uint64_t>(p.unit_blocks) * p.block_bytes;
  uint32_t acc = 0;
  for (uint32_t b = 0; b < p.unit_blocks; ++b) {
    uint8_t* kv = reinterpret_cast<uint8_t*>(p.dst[static_cast<uint64_t>(o) * p.unit_blocks + b]);
    if (kv) warp_move<true, true>(p.vec16, src + b * p.block_bytes, kv, p.block_bytes, b * p.block_bytes, t, acc, lane);
    else warp_move<false, true>(p.vec16, src + b * p.block_bytes, nullptr, p.block_bytes, b * p.block_bytes, t, acc, lane);  // skipped
  }
  if (payload < p.obj_bytes) warp_move<false, true>(p.vec16, src + payload, nullptr, p.obj_bytes - payload, payload, t, acc, lane);
  const uint64_t sum = warp_crc(p.vec16, crc_shift, crc_shift + 32, acc, p.crc_xor, lane);
  if (lane == 0) vstore<uint8_t>(&p.bad[o], sum != p.expect[o] ? 1 : 0);
}

}  // namespace gpu
}  // namespace tutti
