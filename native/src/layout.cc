#include "tutti/layout.h"

#include <cstring>

namespace tutti {

namespace {
uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}
}  // namespace

uint64_t header_bytes_for(uint32_t num_objs) {
  return align_up(sizeof(HeaderFixed) + static_cast<uint64_t>(num_objs) * sizeof(uint64_t));
}

Status make_geometry(const std::vector<LayerKV>& layers, uint32_t unit_blocks, const std::string& desc,
                     Geometry* out) {
  if (layers.empty()) return {Code::kLayout, "no KV cache layers given"};
  if (unit_blocks == 0) return {Code::kConfig, "unit_blocks must be positive"};
  const LayerKV& l0 = layers[0];
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerKV& l = layers[i];
    if (l.nptr != l0.nptr || l.block_bytes != l0.block_bytes)
      return {Code::kLayout, "layer " + std::to_string(i) + " differs in layout from layer 0"};
    if (l.block_bytes == 0 || l.block_bytes % 4 != 0)
      return {Code::kLayout, "block_bytes must be a positive multiple of 4"};
    if (l.nptr != 1 && l.nptr != 2) return {Code::kLayout, "each layer needs 1 or 2 object pointers"};
  }
  if (desc.size() >= kDescBytes) return {Code::kLayout, "layout description too long"};
  Geometry g;
  g.num_layers = static_cast<uint32_t>(layers.size());
  g.objs_per_layer = l0.nptr;
  g.unit_blocks = unit_blocks;
  g.block_bytes = l0.block_bytes;
  g.obj_bytes = align_up(static_cast<uint64_t>(unit_blocks) * l0.block_bytes);
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

void encode_header(const Geometry& g, const std::string& desc, uint64_t key, uint64_t seq,
                   const uint64_t* obj_checksums, uint8_t* buf) {
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
  std::memcpy(h.desc, desc.data(), desc.size());
  std::memcpy(buf, &h, sizeof(h));
  std::memcpy(buf + sizeof(h), obj_checksums, sizeof(uint64_t) * g.num_objs());
  const uint64_t n = sizeof(h) + sizeof(uint64_t) * g.num_objs();
  uint64_t cs = checksum(buf, n) ^ 0x5bd1e9955bd1e995ull;
  std::memcpy(buf + offsetof(HeaderFixed, header_checksum), &cs, sizeof(cs));
}

bool decode_header(const Geometry& g, const uint8_t* buf, uint64_t* key, uint64_t* seq,
                   uint64_t* obj_checksums) {
  HeaderFixed h;
  std::memcpy(&h, buf, sizeof(h));
  if (h.magic != kHeaderMagic || h.version != kHeaderVersion || h.layout_id != g.layout_id ||
      h.num_objs != g.num_objs() || h.obj_bytes != g.obj_bytes || h.unit_blocks != g.unit_blocks)
    return false;
  const uint64_t n = sizeof(h) + sizeof(uint64_t) * g.num_objs();
  if (n > g.header_bytes) return false;
  // Recompute with the checksum field zeroed.
  std::vector<uint8_t> tmp(buf, buf + n);
  std::memset(tmp.data() + offsetof(HeaderFixed, header_checksum), 0, sizeof(uint64_t));
  if ((checksum(tmp.data(), n) ^ 0x5bd1e9955bd1e995ull) != h.header_checksum) return false;
  *key = h.key;
  *seq = h.commit_seq;
  std::memcpy(obj_checksums, buf + sizeof(h), sizeof(uint64_t) * g.num_objs());
  return true;
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

Status ExtentMap::build(const int64_t* block_ids, uint32_t n, std::vector<Extent>* out) const {
  uint32_t i = 0;
  while (i < n) {
    int64_t b = block_ids[i];
    if (b < 0 || static_cast<uint64_t>(b) >= num_blocks_)
      return {Code::kLayout, "block id " + std::to_string(b) + " out of range [0, " + std::to_string(num_blocks_) + ")"};
    uint32_t j = i + 1;
    while (j < n && block_ids[j] == block_ids[j - 1] + 1 && static_cast<uint64_t>(block_ids[j]) < num_blocks_) ++j;
    out->push_back(Extent{static_cast<uint64_t>(b), j - i, i});
    i = j;
  }
  return Status::Ok();
}

}  // namespace tutti
