// The on-disk header of a GPU file (layout.cc): its format, encoding and verification.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tutti/layout.h"

namespace tutti {

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

}  // namespace tutti
