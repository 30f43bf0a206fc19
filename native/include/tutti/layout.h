// GPU-file geometry, the on-disk header, and the extent map (the paper's P2P memory map).
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

// On-disk header at the start of each slot. Written after all of the unit's objects: a slot whose
// header does not verify is free space, never a hit.
constexpr uint64_t kHeaderMagic = 0x31495454554e4b56ull;  // "VKNUTTI1"
constexpr uint32_t kHeaderVersion = 1;
constexpr size_t kDescBytes = 96;

struct HeaderFixed {
  uint64_t magic;
  uint32_t version;
  uint32_t num_objs;
  uint64_t key;
  uint64_t layout_id;
  uint64_t commit_seq;  // orders commits across restarts (LRU rebuild)
  uint64_t obj_bytes;
  uint64_t block_bytes;
  uint32_t unit_blocks;
  uint32_t num_layers;
  char desc[kDescBytes];  // engine's shape/dtype text, e.g. "bfloat16[16,8,128]x2"
  uint64_t header_checksum;  // over this struct with this field zero, plus the object checksums
  // followed by uint64_t obj_checksum[num_objs]
};

uint64_t header_bytes_for(uint32_t num_objs);
// Fills `buf` (header_bytes long) for a committed unit.
void encode_header(const Geometry& g, const std::string& desc, uint64_t key, uint64_t seq,
                   const uint64_t* obj_checksums, uint8_t* buf);
// True when `buf` holds a valid header of geometry `g`; fills key, seq and the object checksums.
bool decode_header(const Geometry& g, const uint8_t* buf, uint64_t* key, uint64_t* seq,
                   uint64_t* obj_checksums);

// Extent: a run of consecutive KV blocks of one cache unit (16 bytes, as in the paper).
struct Extent {
  uint64_t first_block;
  uint32_t num_blocks;
  uint32_t unit_offset_blocks;  // where the run starts inside the unit's object
};

// The registered KV cache: per-layer descriptors plus the request-independent part of the map.
class ExtentMap {
 public:
  Status init(const std::vector<LayerKV>& layers);
  const std::vector<LayerKV>& layers() const { return layers_; }
  uint64_t num_blocks() const { return num_blocks_; }
  // Splits one unit's block ids into runs of consecutive ids. O(blocks), done once per request.
  Status build(const int64_t* block_ids, uint32_t n, std::vector<Extent>* out) const;
  // Address of block `block` of object `kv` of `layer`.
  uint8_t* addr(uint32_t layer, uint32_t kv, uint64_t block) const {
    const LayerKV& l = layers_[layer];
    return reinterpret_cast<uint8_t*>(l.ptr[kv] + block * l.block_stride);
  }
  uint64_t memory_bytes() const { return layers_.size() * sizeof(LayerKV); }

 private:
  std::vector<LayerKV> layers_;
  uint64_t num_blocks_ = 0;
};

}  // namespace tutti
