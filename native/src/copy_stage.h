// Which objects of a retrieve the copy engine stages in device memory before the I/O kernel runs
// (the CUDA backend's copy_engine_mb). Host-only planning, kept apart from the kernel so that the
// native tests check it on hosts without a GPU.
//
// A unit whose objects lie in a mapped pool file (the memory tier, or storage on a memory file
// system) gets a slot per request. At each layer, the launch copies the layer's objects of its
// units' slots (objs_per_layer x obj_bytes, contiguous in the file) into its lane's device area, as
// many as the area holds; the kernel then reads those objects from device memory instead of loading
// them over PCIe itself, and the rest as before.
//
// The driver takes about a microsecond of the engine thread per copy it queues, so the copies go as
// few 2D copies: units striped round-robin over N pool files and stored together lie in consecutive
// slots of each file, so every N-th unit of a request is one step further in both its file and the
// device area, and a run of them is one copy (runs()).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gio_queue.h"

namespace tutti {

constexpr uint32_t kNoCopy = UINT32_MAX;

// One copy of a launch: `count` rows of `width` bytes (a unit's objects of one layer), the i-th from
// host address src + i * src_step to device-area unit dst + i * dst_step. A run of one row goes into
// the batched copy instead.
struct CopyRun {
  uint64_t src, src_step;
  uint32_t dst, dst_step, count;
};

struct CopyStage {
  std::vector<uint32_t> units;  // per slot: its unit, increasing
  std::vector<uint64_t> src;    // per slot: host address of its layer-0 objects in the mapping
  std::vector<uint32_t> path;   // per slot: its pool file

  // Fills `slot_of_unit` ([num_units]: the unit's slot or kNoCopy) and the slots. `mapped`: per
  // pool file, its mapping or null; a unit without a slot in the pool (kNoSlot) gets none.
  void plan(const Ioctx* ctx, uint32_t num_units, uint32_t objs_per_layer, const std::vector<uint8_t*>& mapped,
            uint64_t header_bytes, uint32_t* slot_of_unit) {
    units.clear();
    src.clear();
    path.clear();
    for (uint32_t u = 0; u < num_units; ++u) {
      const Ioctx& x = ctx[static_cast<uint64_t>(u) * objs_per_layer];
      const bool in_map = x.slot != kNoSlot && x.path < mapped.size() && mapped[x.path];
      slot_of_unit[u] = in_map ? static_cast<uint32_t>(units.size()) : kNoCopy;
      if (!in_map) continue;
      units.push_back(u);
      src.push_back(reinterpret_cast<uint64_t>(mapped[x.path]) + x.file_offset + header_bytes);
      path.push_back(x.path);
    }
  }

  // Appends to `runs` the copies of slots [lo, hi) at byte offset `layer_off` of their objects, the
  // slots going to device-area units at, at + 1, ... Each row joins the open run of its pool file
  // when it continues that run's steps in both the file and the area (the run's second row sets the
  // steps, from width up to max_step); otherwise it opens a new run there. `open` is scratch.
  void runs(uint32_t lo, uint32_t hi, uint64_t layer_off, uint32_t at, uint64_t width, uint64_t max_step,
            std::vector<CopyRun>* runs, std::vector<uint32_t>* open) const {
    open->clear();
    for (uint32_t s = lo; s < hi; ++s, ++at) {
      const uint64_t from = src[s] + layer_off;
      if (path[s] >= open->size()) open->resize(path[s] + 1, UINT32_MAX);
      uint32_t& o = (*open)[path[s]];
      if (o != UINT32_MAX) {
        CopyRun& r = (*runs)[o];
        const bool joins = r.count == 1 ? from >= r.src + width && from - r.src <= max_step &&
                                              (at - r.dst) * width <= max_step
                                        : from == r.src + r.count * r.src_step && at == r.dst + r.count * r.dst_step;
        if (joins) {
          if (r.count == 1) {
            r.src_step = from - r.src;
            r.dst_step = at - r.dst;
          }
          ++r.count;
          continue;
        }
      }
      o = static_cast<uint32_t>(runs->size());
      runs->push_back({from, 0, at, 0, 1});
    }
  }

  // The slots [*lo, *hi) of the units that IOCTXs [first, first + count) of a request belong to
  // (unit-major: IOCTX i is object i mod objs_per_layer of unit i / objs_per_layer).
  void slots_of(uint32_t first, uint32_t count, uint32_t objs_per_layer, uint32_t* lo, uint32_t* hi) const {
    const uint32_t u0 = first / objs_per_layer, u1 = count ? (first + count - 1) / objs_per_layer + 1 : u0;
    *lo = static_cast<uint32_t>(std::lower_bound(units.begin(), units.end(), u0) - units.begin());
    *hi = static_cast<uint32_t>(std::lower_bound(units.begin(), units.end(), u1) - units.begin());
  }
};

}  // namespace tutti
