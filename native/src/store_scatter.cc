// The engine session's scatter tickets (store.h): units held in host memory placed into KV blocks.
#include "tutti/store.h"

#include "backend.h"
#include "extent.h"

namespace tutti {

Status Store::scatter_unit(const uint8_t* data, uint64_t n, const int64_t* block_ids, uint64_t n_blocks) {
  uint64_t ticket = 0;
  Status st = scatter_unit_async(data, n, block_ids, n_blocks, -1, &ticket);
  return st.ok() ? scatter_wait(ticket) : st;
}

Status Store::take_scatter_slot(uint32_t* slot, uint64_t* ticket) {
  std::lock_guard<std::mutex> lk(scatter_mu_);
  for (uint32_t i = 0; i < kScatterSlots; ++i)
    if (!scatter_ticket_[i]) {
      scatter_ticket_[i] = *ticket = next_ticket_++;
      scatter_waited_[i] = false;
      *slot = i;
      return Status::Ok();
    }
  return {Code::kCapacityExceeded,
          std::to_string(kScatterSlots) + " scatters in flight: wait for one (scatter_wait) first"};
}

void Store::free_scatter_slot(uint32_t slot) {
  std::lock_guard<std::mutex> lk(scatter_mu_);
  scatter_ticket_[slot] = 0;
  scatter_waited_[slot] = false;
}

Status Store::scatter_unit_async(const uint8_t* data, uint64_t n, const int64_t* block_ids, uint64_t n_blocks,
                                 int64_t stream, uint64_t* ticket, const uint64_t* want_key) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  const Geometry& g = geom_;
  if (n_blocks != g.unit_blocks) return {Code::kLayout, "scatter_unit needs exactly one unit of block ids"};
  uint64_t key;
  uint32_t blocks;
  std::vector<uint64_t> sums;
  Status st = decode_unit(data, n, &key, &blocks, &sums);
  if (!st.ok()) return st;
  if (want_key && key != *want_key)
    return {Code::kNotFound, "the unit holds key " + std::to_string(key) + ", not " + std::to_string(*want_key)};
  if (blocks != g.unit_blocks)
    return {Code::kLayout, "scatter_unit moves whole units; this one holds " + std::to_string(blocks) + " of " +
                               std::to_string(g.unit_blocks) + " blocks (a prefix's partial tail)"};
  std::vector<Extent> ext;
  st = extents_->build(block_ids, g.unit_blocks, &ext, true);
  if (st.ok()) st = extents_->check_distinct(ext);
  if (!st.ok()) return st;
  std::vector<uint64_t> dst(static_cast<uint64_t>(g.num_objs()) * g.unit_blocks);  // 0: a skipped block
  for (uint32_t l = 0; l < g.num_layers; ++l)
    for (uint32_t o = 0; o < g.objs_per_layer; ++o) {
      uint64_t* d = dst.data() + (static_cast<uint64_t>(l) * g.objs_per_layer + o) * g.unit_blocks;
      for (const Extent& e : ext)
        for (uint32_t j = 0; j < e.num_blocks && !e.skip(); ++j)
          d[e.unit_offset_blocks + j] = reinterpret_cast<uint64_t>(extents_->addr(l, o, e.first_block + j));
    }
  uint32_t slot = 0;
  if (!(st = take_scatter_slot(&slot, ticket)).ok()) return st;
  st = backend_->scatter_from_host(slot, data, dst.data(), sums.data(), stream);
  if (!st.ok()) free_scatter_slot(slot);  // nothing of it is left in flight to wait for
  return st;
}

Status Store::scatter_wait(uint64_t ticket) {
  uint32_t slot = kScatterSlots;
  {
    std::lock_guard<std::mutex> lk(scatter_mu_);
    for (uint32_t i = 0; i < kScatterSlots; ++i)
      if (ticket && scatter_ticket_[i] == ticket && !scatter_waited_[i]) slot = i;
    if (slot == kScatterSlots) return {Code::kInvalid, "no scatter " + std::to_string(ticket) + " in flight"};
    scatter_waited_[slot] = true;
  }
  int64_t bad = -1;
  Status st = backend_->scatter_wait(slot, &bad);
  free_scatter_slot(slot);
  if (!st.ok()) return st;
  if (bad >= 0) {
    std::lock_guard<std::mutex> lk(mu_);
    checksum_failures_++;
    return {Code::kNotFound, "unit object " + std::to_string(bad) + " fails its checksum: its blocks hold no valid KV"};
  }
  return Status::Ok();
}

}  // namespace tutti
