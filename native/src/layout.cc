#include "tutti/layout.h"

#include <algorithm>
#include <cstring>

#include "extent.h"
#include "header.h"
#include "tutti/crc32c.h"

namespace tutti {

namespace {
uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}
}  // namespace

uint64_t header_bytes_for(uint32_t num_objs) {
  return align_up(sizeof(HeaderFixed) + sizeof(uint64_t) + static_cast<uint64_t>(num_objs) * sizeof(uint64_t));
}

Status make_geometry(const std::vector<LayerKV>& layers, uint32_t unit_blocks, const std::string& desc,
                     Geometry* out) {
  if (layers.empty()) return {Code::kLayout, "no KV cache layers given"};
  const LayerKV& l0 = layers[0];
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerKV& l = layers[i];
    if (l.nptr != l0.nptr || l.block_bytes != l0.block_bytes)
      return {Code::kLayout, "layer " + std::to_string(i) + " differs in layout from layer 0"};
  }
  return make_geometry(static_cast<uint32_t>(layers.size()), l0.nptr, l0.block_bytes, unit_blocks, desc, out);
}

Status make_geometry(uint32_t num_layers, uint32_t objs_per_layer, uint64_t block_bytes, uint32_t unit_blocks,
                     const std::string& desc, Geometry* out) {
  if (num_layers == 0) return {Code::kLayout, "no KV cache layers given"};
  if (num_layers > kMaxLayers)
    return {Code::kLayout, std::to_string(num_layers) + " layers: at most " + std::to_string(kMaxLayers) + " are supported"};
  if (unit_blocks == 0) return {Code::kConfig, "unit_blocks must be positive"};
  if (block_bytes == 0 || block_bytes % 4 != 0) return {Code::kLayout, "block_bytes must be a positive multiple of 4"};
  if (objs_per_layer != 1 && objs_per_layer != 2) return {Code::kLayout, "each layer needs 1 or 2 object pointers"};
  if (desc.size() >= kDescBytes) return {Code::kLayout, "layout description too long"};
  // Compared by division first: unit_blocks * block_bytes may not fit in 64 bits.
  if (block_bytes >= kMaxObjBytes || unit_blocks > kMaxObjBytes / block_bytes ||
      align_up(static_cast<uint64_t>(unit_blocks) * block_bytes) >= kMaxObjBytes)
    return {Code::kLayout, "objects of " + std::to_string(unit_blocks) + " blocks of " + std::to_string(block_bytes) +
                               " bytes: the checksum covers objects below 256 MiB (lower unit_tokens)"};
  Geometry g;
  g.num_layers = num_layers;
  g.objs_per_layer = objs_per_layer;
  g.unit_blocks = unit_blocks;
  g.block_bytes = block_bytes;
  g.obj_bytes = align_up(static_cast<uint64_t>(unit_blocks) * block_bytes);
  g.header_bytes = header_bytes_for(g.num_objs());
  g.slot_bytes = g.header_bytes + g.obj_bytes * g.num_objs();
  uint64_t h = 0x7475747469ull;
  for (uint64_t v : {uint64_t(g.num_layers), uint64_t(g.objs_per_layer), uint64_t(g.unit_blocks), g.block_bytes})
    h = mix(h, v);
  for (char c : desc) h = mix(h, static_cast<uint8_t>(c));
  g.layout_id = h;
  *out = g;
  return Status::Ok();
}

std::string layout_text(const std::string& desc, uint32_t num_layers, uint32_t unit_blocks) {
  return desc + ", " + std::to_string(num_layers) + " layers, " + std::to_string(unit_blocks) + " blocks per unit";
}

uint64_t object_tag(uint64_t key, uint64_t seq, uint32_t obj) {
  auto splitmix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  return splitmix(key ^ splitmix(seq ^ splitmix(0x6f626a0000000000ull | obj)));
}

namespace {

// Where the object list starts: format 3 puts the block word before it.
uint64_t list_at(uint32_t version) { return sizeof(HeaderFixed) + (version >= 3 ? sizeof(uint64_t) : 0); }
uint64_t header_list_bytes(uint32_t version, uint32_t num_objs) { return list_at(version) + sizeof(uint64_t) * num_objs; }

// CRC32C of the header's first `n` bytes with the checksum field read as zero.
uint32_t header_crc(const uint8_t* buf, uint64_t n) {
  constexpr size_t at = offsetof(HeaderFixed, header_checksum);
  const uint64_t zero = 0;
  uint32_t c = crc32c_extend(0, buf, at);
  c = crc32c_extend(c, &zero, sizeof(zero));
  return crc32c_extend(c, buf + at + sizeof(zero), n - at - sizeof(zero));
}

// Format 1's header checksum (two position-weighted sums), kept only to recognise its pools.
bool legacy_header_ok(const uint8_t* buf, uint64_t n, uint64_t stored) {
  uint32_t lo = 0, hi = 0;
  constexpr size_t at = offsetof(HeaderFixed, header_checksum);
  for (uint64_t i = 0; i < n / 4; ++i) {
    uint32_t w;
    std::memcpy(&w, buf + 4 * i, 4);
    if (4 * i >= at && 4 * i < at + 8) w = 0;
    lo += w;
    hi += w * static_cast<uint32_t>(2 * i + 1);
  }
  return (((static_cast<uint64_t>(hi) << 32) | lo) ^ 0x5bd1e9955bd1e995ull) == stored;
}

}  // namespace

uint32_t header_inner_room(const Geometry& g) {
  return static_cast<uint32_t>((g.header_bytes - header_list_bytes(kHeaderVersion, g.num_objs())) / sizeof(uint64_t));
}

uint32_t encode_header(const Geometry& g, const std::string& desc, uint64_t key, uint64_t seq, uint32_t blocks,
                       const uint64_t* obj_crcs, uint8_t* buf, const uint64_t* inner, uint32_t n_inner) {
  n_inner = inner ? std::min({n_inner, blocks ? blocks - 1 : 0, header_inner_room(g)}) : 0;
  std::memset(buf, 0, g.header_bytes);
  HeaderFixed h{};
  h.magic = kHeaderMagic;
  h.version = kHeaderVersion;
  h.num_objs = g.num_objs();
  h.key = key;
  h.layout_id = g.layout_id;
  h.commit_seq = seq;
  h.obj_bytes = g.obj_bytes;
  h.block_bytes = g.block_bytes;
  h.unit_blocks = g.unit_blocks;
  h.num_layers = g.num_layers;
  std::memcpy(h.desc, desc.data(), std::min(desc.size(), kDescBytes - 1));
  std::memcpy(buf, &h, sizeof(h));
  const uint64_t word = blocks | static_cast<uint64_t>(n_inner) << 32;
  std::memcpy(buf + sizeof(h), &word, sizeof(word));
  const uint64_t at = list_at(kHeaderVersion);
  for (uint32_t o = 0; o < g.num_objs(); ++o) {
    const uint64_t v = (obj_crcs[o] & 0xffffffffull) ^ object_tag(key, seq, o);
    std::memcpy(buf + at + 8 * o, &v, 8);
  }
  const uint64_t end = header_list_bytes(kHeaderVersion, g.num_objs());
  if (n_inner) std::memcpy(buf + end, inner, sizeof(uint64_t) * n_inner);
  const uint64_t cs = header_crc(buf, end + sizeof(uint64_t) * n_inner);
  std::memcpy(buf + offsetof(HeaderFixed, header_checksum), &cs, sizeof(cs));
  return n_inner;
}

void encode_free_header(const Geometry& g, const std::string& desc, uint8_t* buf) {
  const std::vector<uint64_t> zero(g.num_objs(), 0);
  encode_header(g, desc, 0, 0, 0, zero.data(), buf);
}

HeaderState decode_header(const Geometry& g, const uint8_t* buf, uint64_t* key, uint64_t* seq, uint32_t* blocks,
                          uint64_t* obj_crcs, std::string* other, std::vector<uint64_t>* inner) {
  HeaderFixed h;
  std::memcpy(&h, buf, sizeof(h));
  if (std::all_of(buf, buf + sizeof(h), [](uint8_t b) { return b == 0; })) return HeaderState::kEmpty;
  // The object list's length comes from the header itself: bound it by the slot's header space
  // before it is read, and trust no other field until the checksum holds.
  const uint64_t max_objs = (g.header_bytes - list_at(3)) / sizeof(uint64_t);
  if (h.magic != kHeaderMagic || h.num_objs > max_objs) return HeaderState::kCorrupt;
  if (h.version == 1)
    return legacy_header_ok(buf, header_list_bytes(1, h.num_objs), h.header_checksum) ? HeaderState::kOldFormat
                                                                                       : HeaderState::kCorrupt;
  if (h.version < 2 || h.version > kHeaderVersion) return HeaderState::kCorrupt;
  // Format 4's inner key count, bounded by the header's room before the checksum that covers it.
  uint64_t word = g.unit_blocks;  // format 2: whole units
  if (h.version >= 3) std::memcpy(&word, buf + sizeof(h), sizeof(word));
  const uint64_t n_inner = h.version >= 4 ? word >> 32 : 0;
  if (h.version >= 4) word &= 0xffffffffull;
  const uint64_t end = header_list_bytes(h.version, h.num_objs);
  if (n_inner > (g.header_bytes - end) / sizeof(uint64_t) ||
      h.header_checksum != header_crc(buf, end + sizeof(uint64_t) * n_inner))
    return HeaderState::kCorrupt;
  if (h.layout_id != g.layout_id || h.num_objs != g.num_objs() || h.obj_bytes != g.obj_bytes ||
      h.unit_blocks != g.unit_blocks || h.block_bytes != g.block_bytes || h.num_layers != g.num_layers) {
    if (other) *other = layout_text(std::string(h.desc, strnlen(h.desc, kDescBytes)), h.num_layers, h.unit_blocks);
    return HeaderState::kOtherLayout;
  }
  if (word == 0 && h.key == 0 && h.commit_seq == 0 && n_inner == 0) return HeaderState::kEmpty;  // a free slot's
  if (word == 0 || word > g.unit_blocks || (n_inner && n_inner >= word)) return HeaderState::kCorrupt;
  const uint64_t at = list_at(h.version);
  for (uint32_t o = 0; o < g.num_objs(); ++o) {
    uint64_t v;
    std::memcpy(&v, buf + at + 8 * o, 8);
    v ^= object_tag(h.key, h.commit_seq, o);
    if (v >> 32) return HeaderState::kCorrupt;
    obj_crcs[o] = v;
  }
  if (inner) {
    inner->resize(n_inner);
    if (n_inner) std::memcpy(inner->data(), buf + end, sizeof(uint64_t) * n_inner);
  }
  *key = h.key;
  *seq = h.commit_seq;
  *blocks = static_cast<uint32_t>(word);
  return HeaderState::kValid;
}

Status ExtentMap::init(const std::vector<LayerKV>& layers) {
  layers_ = layers;
  num_blocks_ = layers.empty() ? 0 : layers[0].num_blocks;
  for (const LayerKV& l : layers) {
    if (l.num_blocks != num_blocks_) return {Code::kLayout, "all layers must have the same number of blocks"};
    for (uint32_t k = 0; k < l.nptr; ++k)
      if (l.ptr[k] == 0) return {Code::kLayout, "null KV cache pointer"};
    if (l.block_stride < l.block_bytes && l.num_blocks > 1)
      return {Code::kLayout, "block_stride smaller than block_bytes: objects would overlap"};
  }
  return Status::Ok();
}

Status ExtentMap::build(const int64_t* block_ids, uint32_t n, std::vector<Extent>* out, bool skip) const {
  uint32_t i = 0;
  while (i < n) {
    int64_t b = block_ids[i];
    uint32_t j = i + 1;
    if (b == kSkipBlockId && skip) {
      while (j < n && block_ids[j] == kSkipBlockId) ++j;
      out->push_back(Extent{kSkipBlock, j - i, i});
      i = j;
      continue;
    }
    if (b < 0 || static_cast<uint64_t>(b) >= num_blocks_)
      return {Code::kLayout, "block id " + std::to_string(b) + " out of range [0, " + std::to_string(num_blocks_) + ")" +
                                 (b == kSkipBlockId ? " (-1, skip the block, is for retrieves only)" : "")};
    while (j < n && block_ids[j] == block_ids[j - 1] + 1 && static_cast<uint64_t>(block_ids[j]) < num_blocks_) ++j;
    out->push_back(Extent{static_cast<uint64_t>(b), j - i, i});
    i = j;
  }
  return Status::Ok();
}

Status ExtentMap::check_distinct(const std::vector<Extent>& extents) const {
  std::vector<uint64_t> seen((num_blocks_ + 63) / 64);
  for (const Extent& e : extents) {
    for (uint32_t j = 0; j < e.num_blocks && !e.skip(); ++j) {
      const uint64_t b = e.first_block + j;
      if (seen[b / 64] >> (b % 64) & 1)
        return {Code::kLayout, "block id " + std::to_string(b) + " appears twice: a retrieve writes each block once"};
      seen[b / 64] |= 1ull << (b % 64);
    }
  }
  return Status::Ok();
}

}  // namespace tutti
