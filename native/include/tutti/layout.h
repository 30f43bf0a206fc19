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
// The same from the sizes alone (a unit store: no KV memory).
Status make_geometry(uint32_t num_layers, uint32_t objs_per_layer, uint64_t block_bytes, uint32_t unit_blocks,
                     const std::string& desc, Geometry* out);

// On-disk header at the start of each slot. Written after all of the unit's objects: a slot whose
// header does not verify is free space, never a hit.
//
// Format 3: every checksum is CRC32C (crc32c.h). After the fixed part comes one word, the number of
// the unit's KV blocks it holds (1 to unit_blocks: a prefix's last unit may be partial; the objects'
// bytes past those blocks are zeros), then the object checksum list. The header's own checksum
// covers all three (with its own field zero). Each entry of the list is the object's CRC32C xor a
// 64-bit tag of (key, commit_seq, object index), so an object's checksum is bound to the unit, the
// commit and its place: a header's list, decoded, yields the plain CRC32C each object must have,
// and an entry that decodes to more than 32 bits means the header is damaged.
// Format 4 adds the unit's inner block keys: the block word's high 32 bits count them (at most
// blocks - 1, and no more than the header's space after the list holds), and they follow the list,
// under the header checksum. Inner key j is the key a unit ending after block j + 1 of this one would
// have (the engine's hash of the prefix up to there): a lookup that names it may load this unit's
// leading j + 1 blocks. Format 3 is format 4 without inner keys.
// Format 2 is format 3 without the block word (every unit whole): its pools are read as such.
// Format 1 (an additive checksum that missed two-bit errors) is recognised only to refuse its pools.
constexpr uint64_t kHeaderMagic = 0x31495454554e4b56ull;  // "VKNUTTI1"
constexpr uint32_t kHeaderVersion = 4;
constexpr size_t kDescBytes = 96;
// CRC32C detects every error of up to 3 bits only below 2^31 bits: objects stay under 256 MiB.
constexpr uint64_t kMaxObjBytes = 1ull << 28;
// Layers of a model at most (a header holds 2 checksums per layer: 128 KiB at most).
constexpr uint32_t kMaxLayers = 8192;

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
  uint64_t header_checksum;  // CRC32C over this struct with this field zero, plus the object list
  // followed by uint64_t obj_checksum[num_objs]: CRC32C of the object xor object_tag()
};

uint64_t header_bytes_for(uint32_t num_objs);
// A layout in words, as errors name it: "bfloat16[16,8,128]x2, 32 layers, 16 blocks per unit".
std::string layout_text(const std::string& desc, uint32_t num_layers, uint32_t unit_blocks);
// The tag folded into the checksum of object `obj` (layer * objs_per_layer + K/V) of a commit.
uint64_t object_tag(uint64_t key, uint64_t seq, uint32_t obj);
// Inner keys a header of geometry `g` holds at most (the room after its object list).
uint32_t header_inner_room(const Geometry& g);
// Fills `buf` (header_bytes long) for a committed unit of `blocks` KV blocks; `obj_crcs` are the
// objects' plain CRC32C; `inner`: its first min(n_inner, blocks - 1, header_inner_room) inner keys,
// which is the count returned.
uint32_t encode_header(const Geometry& g, const std::string& desc, uint64_t key, uint64_t seq, uint32_t blocks,
                   const uint64_t* obj_crcs, uint8_t* buf, const uint64_t* inner = nullptr, uint32_t n_inner = 0);

// Fills `buf` with this layout's free-slot header: it verifies like a unit's header but holds no
// unit (key, sequence and blocks 0). Freed slots carry it, and the first slot of every pool file a
// writer opens does while it holds no unit: so a pool file names its layout from its first open on,
// and a store of another layout refuses it even when none of its units is left (decode_header:
// kOtherLayout), instead of taking it over.
void encode_free_header(const Geometry& g, const std::string& desc, uint8_t* buf);

enum class HeaderState {
  kValid,        // a committed unit of this layout
  kEmpty,        // a free slot: all zero, or this layout's free-slot header (encode_free_header)
  kCorrupt,      // anything else that does not verify (torn, damaged, foreign bytes)
  kOtherLayout,  // a header that verifies, of another layout (`other` names it)
  kOldFormat,    // a header that verifies as format 1
};
// Verifies `buf` (header_bytes of geometry `g`) before trusting any field; when valid fills key,
// seq, the unit's blocks, the objects' plain CRC32C values (`obj_crcs`, num_objs entries) and, when
// given, the inner keys (`inner`, none before format 4).
HeaderState decode_header(const Geometry& g, const uint8_t* buf, uint64_t* key, uint64_t* seq, uint32_t* blocks,
                          uint64_t* obj_crcs, std::string* other = nullptr, std::vector<uint64_t>* inner = nullptr);

// A retrieve's block id -1 (kSkipBlockId): the unit's block at that place is read and checked with
// the rest of its object but written nowhere (the engine holds it already, and others may read it).
constexpr int64_t kSkipBlockId = -1;
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
