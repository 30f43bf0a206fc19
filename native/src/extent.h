// The extent map (layout.cc): the engine's KV memory as per-layer descriptors, and a request's
// block ids as runs of consecutive blocks (the paper's P2P memory map).
#pragma once

#include <cstdint>
#include <vector>

#include "tutti/common.h"
#include "tutti/layout.h"

namespace tutti {

// first_block of an extent of skipped blocks (kSkipBlockId, layout.h).
constexpr uint64_t kSkipBlock = ~0ull;

// Extent: a run of consecutive KV blocks of one cache unit (16 bytes, as in the paper).
struct Extent {
  uint64_t first_block;  // kSkipBlock: a retrieve verifies these blocks' bytes and places none
  uint32_t num_blocks;
  uint32_t unit_offset_blocks;  // where the run starts inside the unit's object
  bool skip() const { return first_block == kSkipBlock; }
};

// The registered KV cache: per-layer descriptors plus the request-independent part of the map.
class ExtentMap {
 public:
  Status init(const std::vector<LayerKV>& layers);
  const std::vector<LayerKV>& layers() const { return layers_; }
  uint64_t num_blocks() const { return num_blocks_; }
  // Splits one unit's block ids into runs of consecutive ids (and runs of kSkipBlockId, when
  // `skip` allows them: retrieves only). O(blocks), done once per request.
  Status build(const int64_t* block_ids, uint32_t n, std::vector<Extent>* out, bool skip = false) const;
  // Fails when two extents (skips aside) name one block: a retrieve would write it twice, from two
  // places, and could leave it torn while each source passes its checksum. O(blocks + num_blocks / 64).
  Status check_distinct(const std::vector<Extent>& extents) const;
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
