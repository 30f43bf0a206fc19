// The engine's KV layers and the GPU-file geometry (engine API). The on-disk header (header.h) and
// the extent map (extent.h) are the core's own, in native/src.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tutti/common.h"

namespace tutti {

// One layer of the engine's paged KV cache. Every (layer, K/V, block) object is `block_bytes`
// contiguous bytes at `ptr[kv] + block_id * block_stride`. One pointer when K and V are interleaved
// in one object (or the layer has a single latent cache, as MLA does), two when K and V are apart.
struct LayerKV {
  uint64_t ptr[2] = {0, 0};
  uint32_t nptr = 0;
  uint64_t block_stride = 0;
  uint64_t block_bytes = 0;
  uint64_t num_blocks = 0;
};

// Geometry of one GPU file (the KV of one cache unit, all layers), stored in one pool slot:
// [header][layer0 obj0][layer0 obj1][layer1 obj0]... Every object is 4 KiB aligned so that each
// storage I/O is one whole object: the tensor-stripe layout.
struct Geometry {
  uint32_t num_layers = 0;
  uint32_t objs_per_layer = 0;  // 2 (K and V apart) or 1 (interleaved / MLA)
  uint32_t unit_blocks = 0;     // KV blocks per cache unit
  uint64_t block_bytes = 0;     // bytes of one block of one object
  uint64_t obj_bytes = 0;       // unit_blocks * block_bytes, 4 KiB aligned
  uint64_t header_bytes = 0;
  uint64_t slot_bytes = 0;
  uint64_t layout_id = 0;       // hash of all of the above plus the engine's dtype/shape text

  uint32_t num_objs() const { return num_layers * objs_per_layer; }
  uint64_t obj_offset(uint32_t layer, uint32_t kv) const {
    return header_bytes + (static_cast<uint64_t>(layer) * objs_per_layer + kv) * obj_bytes;
  }
  uint64_t payload_bytes() const { return static_cast<uint64_t>(unit_blocks) * block_bytes; }
};

Status make_geometry(const std::vector<LayerKV>& layers, uint32_t unit_blocks, const std::string& desc,
                     Geometry* out);
// The same from the sizes alone (a unit store: no KV memory).
Status make_geometry(uint32_t num_layers, uint32_t objs_per_layer, uint64_t block_bytes, uint32_t unit_blocks,
                     const std::string& desc, Geometry* out);

// A retrieve's block id -1 (kSkipBlockId): the unit's block at that place is read and checked with
// the rest of its object but written nowhere (the engine holds it already, and others may read it).
constexpr int64_t kSkipBlockId = -1;

}  // namespace tutti
