// Which objects of a retrieve the copy engine stages in device memory before the I/O kernel runs
// (the CUDA backend's copy_engine_mb). Host-only planning, kept apart from the kernel so that the
// native tests check it on hosts without a GPU.
//
// A unit whose objects lie in a mapped pool file (the memory tier, or storage on a memory file
// system) gets a slot per request. At each layer, the launch copies the layer's objects of its
// units' slots (objs_per_layer x obj_bytes, contiguous in the file) into its lane's device area in
// one batched copy, as many as the area holds; the kernel then reads those objects from device
// memory instead of loading them over PCIe itself, and the rest as before.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gio_queue.h"

namespace tutti {

constexpr uint32_t kNoCopy = UINT32_MAX;

struct CopyStage {
  std::vector<uint32_t> units;  // per slot: its unit, increasing
  std::vector<uint64_t> src;    // per slot: host address of its layer-0 objects in the mapping

  // Fills `slot_of_unit` ([num_units]: the unit's slot or kNoCopy) and the slots. `mapped`: per
  // pool file, its mapping or null; a unit without a slot in the pool (kNoSlot) gets none.
  void plan(const Ioctx* ctx, uint32_t num_units, uint32_t objs_per_layer, const std::vector<uint8_t*>& mapped,
            uint64_t header_bytes, uint32_t* slot_of_unit) {
    units.clear();
    src.clear();
    for (uint32_t u = 0; u < num_units; ++u) {
      const Ioctx& x = ctx[static_cast<uint64_t>(u) * objs_per_layer];
      const bool in_map = x.slot != kNoSlot && x.path < mapped.size() && mapped[x.path];
      slot_of_unit[u] = in_map ? static_cast<uint32_t>(units.size()) : kNoCopy;
      if (!in_map) continue;
      units.push_back(u);
      src.push_back(reinterpret_cast<uint64_t>(mapped[x.path]) + x.file_offset + header_bytes);
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
