// Native unit tests of the core's pieces: rings, checksum, index, extents, headers, file pool, store.
// Prints "N passed, M failed"; exit status 0 only when all pass.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "copy_stage.h"
#include "extent.h"
#include "header.h"
#include "index.h"
#include "pool.h"
#include "ring.h"
#include "tutti/crc32c.h"
#include "tutti/layout.h"
#include "tutti/store.h"

using namespace tutti;

static int g_pass = 0, g_fail = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #cond); \
      throw 1;                                                        \
    }                                                                 \
  } while (0)

static void run(const char* name, void (*f)()) {
  try {
    f();
    ++g_pass;
    std::printf("ok   %s\n", name);
  } catch (...) {
    ++g_fail;
    std::printf("FAIL %s\n", name);
  }
}

static void test_ring_spsc_threads() {
  RingCtl ctl{};
  std::vector<uint64_t> mem(7);  // not a power of two: indices wrap by modulo
  SpscRing<uint64_t> r(&ctl, mem.data(), mem.size());
  const uint64_t n = 2000000;
  std::thread prod([&] {
    for (uint64_t i = 0; i < n; ++i)
      while (!r.push(i)) std::this_thread::yield();
  });
  uint64_t expect = 0, v;
  while (expect < n)
    if (r.pop(&v)) {
      CHECK(v == expect);
      ++expect;
    }
  prod.join();
  CHECK(r.empty());
  CHECK(ctl.head == n && ctl.tail == n);
}

// Bitwise CRC32C: the reference every fast path is checked against.
static uint32_t crc_ref(const uint8_t* p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kCrc32cPoly : c >> 1;
  }
  return ~c;
}

static void test_crc32c_values_and_pieces() {
  const char* v = "123456789";
  CHECK(crc32c_extend(0, v, 9) == 0xE3069283u);  // the published check value
  std::mt19937 rng(1);
  std::vector<uint8_t> buf(3 * 1024 * 5 + 77);
  for (auto& x : buf) x = static_cast<uint8_t>(rng());
  const uint32_t whole = crc_ref(buf.data(), buf.size());
  CHECK(crc32c_extend(0, buf.data(), buf.size()) == whole);
  for (size_t cut : {size_t(0), size_t(1), size_t(4095), size_t(3072), size_t(9000)}) {
    uint32_t c = crc32c_extend(0, buf.data(), cut);
    CHECK(crc32c_extend(c, buf.data() + cut, buf.size() - cut) == whole);
    std::vector<uint8_t> dst(buf.size());
    c = crc32c_copy(0, dst.data(), buf.data(), cut);
    c = crc32c_copy(c, dst.data() + cut, buf.data() + cut, buf.size() - cut);
    CHECK(c == whole && dst == buf);
  }
  // Every length and alignment the fast paths split differently (the 3-stripe and the folding loops,
  // their tails), continued from a nonzero CRC, against the reference.
  for (int t = 0; t < 400; ++t) {
    const size_t off = rng() % 64, len = t < 200 ? static_cast<size_t>(t) * 7 : rng() % 9000;
    const size_t cut = len ? rng() % len : 0;
    std::vector<uint8_t> dst(len + 1);  // never empty: no null pointers into memcpy/memcmp
    uint32_t c = crc32c_copy(0, dst.data(), buf.data() + off, cut);
    c = crc32c_extend(c, buf.data() + off + cut, len - cut);
    std::memcpy(dst.data() + cut, buf.data() + off + cut, len - cut);
    CHECK(c == crc_ref(buf.data() + off, len));
    CHECK(std::memcmp(dst.data(), buf.data() + off, len) == 0);
  }
  // The streaming copy: a 64-byte aligned destination takes the streamed stores, any other the
  // ordinary copy; the same CRC and bytes either way, over every split of the folding loop.
  std::vector<uint8_t> big(16384 + 128);
  uint8_t* aligned = big.data() + (64 - reinterpret_cast<uintptr_t>(big.data()) % 64) % 64;
  for (int t = 0; t < 300; ++t) {
    const size_t off = rng() % 64, dst_off = t % 3 == 0 ? 0 : (t % 3 == 1 ? 64 * (rng() % 4) : 1 + rng() % 63);
    const size_t len = std::min(t < 100 ? static_cast<size_t>(t) * 97 : rng() % 16000, buf.size() - off);
    std::memset(big.data(), 0xa5, big.size());
    const uint32_t seed = static_cast<uint32_t>(rng());
    CHECK(crc32c_copy_stream(seed, aligned + dst_off, buf.data() + off, len) == crc32c_extend(seed, buf.data() + off, len));
    CHECK(std::memcmp(aligned + dst_off, buf.data() + off, len) == 0);
    CHECK(aligned[dst_off + len] == 0xa5);  // nothing past the end
  }
  std::vector<uint8_t> zeros(65536, 0);
  CHECK(crc32c_extend(0, zeros.data(), zeros.size()) != 0);  // an all-zero object has a nonzero CRC
  // Every 1- and 2-bit error over a 4 KiB object changes it (exhaustive over a sample of positions).
  std::vector<uint8_t> obj(4096);
  for (auto& x : obj) x = static_cast<uint8_t>(rng());
  const uint32_t good = crc32c_extend(0, obj.data(), obj.size());
  for (int t = 0; t < 20000; ++t) {
    const uint32_t i = rng() % (8 * 4096), j = rng() % (8 * 4096), k = rng() % (8 * 4096);
    obj[i / 8] ^= 1 << (i % 8);
    if (j != i) obj[j / 8] ^= 1 << (j % 8);
    if (k != i && k != j && t % 2) obj[k / 8] ^= 1 << (k % 8);
    CHECK(crc32c_extend(0, obj.data(), obj.size()) != good);
    obj[i / 8] ^= 1 << (i % 8);
    if (j != i) obj[j / 8] ^= 1 << (j % 8);
    if (k != i && k != j && t % 2) obj[k / 8] ^= 1 << (k % 8);
  }
  // Bit 31 of two words flipped: the error the format-1 sums could not see.
  obj[3] ^= 0x80;
  obj[1003] ^= 0x80;
  CHECK(crc32c_extend(0, obj.data(), obj.size()) != good);
}

// The I/O kernel's lane scheme, run on the host: 32 lanes over 16-byte vectors (or 4-byte words),
// blocks of `block` bytes walked in object order with the lane phase the kernel uses.
template <typename Rows>
static uint32_t lane_crc(const CrcLaneTables& lt, Rows t, const std::vector<uint8_t>& obj, uint64_t block, bool vec16) {
  const uint32_t W = vec16 ? 16 : 4;
  uint32_t acc[32] = {};
  for (uint64_t at = 0; at < obj.size(); at += block) {
    const uint64_t nv = std::min<uint64_t>(block, obj.size() - at) / W;
    const uint32_t phase = static_cast<uint32_t>((at / W) % 32);
    for (uint32_t lane = 0; lane < 32; ++lane)
      for (uint64_t i = (lane - phase) & 31; i < nv; i += 32) {
        uint32_t w[4];
        std::memcpy(w, obj.data() + at + i * W, W);
        acc[lane] = vec16 ? crc_lane_step16(t, acc[lane], w[0], w[1], w[2], w[3]) : crc_lane_step4(t, acc[lane], w[0]);
      }
  }
  uint32_t raw = 0;
  for (uint32_t lane = 0; lane < 32; ++lane)
    raw ^= crc32c_multmodp(vec16 ? lt.lane_shift16[lane] : lt.lane_shift4[lane], acc[lane]);
  return raw ^ crc32c_zeros_xor(obj.size());
}

static void test_crc32c_lane_scheme() {
  static CrcLaneTables t;
  crc32c_lane_tables(&t);
  static uint32_t nib[2 * kCrcRows][16];  // the kernel's nibble rows
  for (uint32_t i = 0; i < 2 * kCrcRows * 16; ++i) nib[i / 16][i % 16] = crc_nibble_entry(t.t, i);
  std::mt19937 rng(2);
  for (uint64_t size : {uint64_t(4096), uint64_t(12288), uint64_t(65536)})
    for (uint64_t block : {uint64_t(2048), uint64_t(1040), uint64_t(4096), uint64_t(48)}) {
      std::vector<uint8_t> obj(size);
      for (auto& x : obj) x = static_cast<uint8_t>(rng());
      const uint32_t want = crc32c_extend(0, obj.data(), obj.size());
      CHECK(lane_crc(t, t.t, obj, block, true) == want);
      CHECK(lane_crc(t, t.t, obj, block, false) == want);
      CHECK(lane_crc(t, nib, obj, block, true) == want);
      CHECK(lane_crc(t, nib, obj, block, false) == want);
      // The I/O kernel's split of a mapped object: four pieces summed apart by the lane scheme,
      // each raw register shifted past the pieces after it, joined by xor.
      const uint64_t piece = size / 4;
      if (piece % 512 != 0 || piece % block != 0) continue;
      for (bool vec16 : {true, false}) {
        uint32_t joined = 0;
        for (uint64_t k = 0; k < 4; ++k) {
          std::vector<uint8_t> part(obj.begin() + k * piece, obj.begin() + (k + 1) * piece);
          const uint32_t raw = lane_crc(t, nib, part, block, vec16) ^ crc32c_zeros_xor(piece);
          joined ^= crc32c_multmodp(crc32c_x8n((3 - k) * piece), raw);
        }
        CHECK((joined ^ crc32c_zeros_xor(size)) == want);
      }
    }
  // A zero vector only shifts the register.
  CHECK(crc_lane_skip16(t.t, 0x12345678u) == crc_lane_step16(t.t, 0x12345678u, 0, 0, 0, 0));
  CHECK(crc_lane_skip4(t.t, 0x12345678u) == crc_lane_step4(t.t, 0x12345678u, 0));
  CHECK(crc_lane_skip16(nib, 0x12345678u) == crc_lane_step16(t.t, 0x12345678u, 0, 0, 0, 0));
}

static void test_index_lru_and_pins() {
  Index ix;
  for (uint64_t k = 1; k <= 4; ++k) ix.insert(k, static_cast<uint32_t>(k * 10), 16);
  uint64_t keys[] = {1, 2, 9, 3};
  CHECK(ix.lookup_prefix(keys, 4) == 2);  // touches 1 and 2
  CHECK(ix.pin(3));
  uint64_t k;
  Index::Copies c;
  CHECK(ix.evict_lru(&k, &c) && k == 4 && c.slot == 40);
  CHECK(ix.evict_lru(&k, &c) && k == 1);  // 3 is pinned
  CHECK(ix.evict_lru(&k, &c) && k == 2);
  CHECK(!ix.evict_lru(&k, &c));
  ix.unpin(3);
  CHECK(ix.evict_lru(&k, &c) && k == 3);
  CHECK(ix.size() == 0);
}

// Two tiers: memory units are demoted to their storage copy or, in memory only, skipped (or
// evicted when asked); storage eviction never takes a unit whose only copy is in memory.
static void test_index_tiers() {
  Index ix;
  ix.insert(1, 100, 16, true);   // memory only
  ix.insert(2, 101, 16, true);
  CHECK(ix.set_copy(2, 101, 7));  // flushed: storage copy in slot 7
  CHECK(!ix.set_copy(2, 101, 8));  // once
  ix.insert(3, 9, 16, false);     // storage only
  CHECK(ix.in_memory() == 2);
  uint64_t k;
  uint32_t slot;
  bool gone;
  // Memory LRU is 1 (oldest), then 2: 1 has no storage copy, so 2 is demoted.
  CHECK(ix.evict_memory_lru(false, &k, &slot, &gone) && k == 2 && slot == 101 && !gone);
  Index::Copies c;
  CHECK(ix.find(2, &c) && c.slot == 7 && !c.mem && c.copy == Index::kNoCopy);
  CHECK(!ix.evict_memory_lru(false, &k, &slot, &gone));
  // Storage eviction skips 1 (memory only): 2 is older than 3.
  CHECK(ix.evict_lru(&k, &c) && k == 2 && c.slot == 7);
  CHECK(ix.promote(3, 9, 102) && ix.find(3, &c) && c.mem && c.slot == 102 && c.copy == 9);
  CHECK(!ix.promote(3, 9, 103));
  // A damaged memory copy: the storage copy serves; then the storage copy too: gone.
  CHECK(ix.drop_copy(3, 102, &gone) && !gone && ix.find(3, &c) && c.slot == 9 && !c.mem);
  CHECK(ix.drop_copy(3, 9, &gone) && gone && !ix.contains(3));
  CHECK(ix.evict_memory_lru(true, &k, &slot, &gone) && k == 1 && slot == 100 && gone);
  CHECK(ix.size() == 0 && ix.in_memory() == 0);
}

static void test_extents() {
  LayerKV l;
  l.nptr = 2;
  l.ptr[0] = 0x1000;
  l.ptr[1] = 0x100000;
  l.block_stride = 64;
  l.block_bytes = 64;
  l.num_blocks = 100;
  ExtentMap m;
  CHECK(m.init({l, l}).ok());
  std::vector<Extent> out;
  int64_t ids[] = {5, 6, 7, 20, 99, 98};
  CHECK(m.build(ids, 6, &out).ok());
  CHECK(out.size() == 4);
  CHECK(out[0].first_block == 5 && out[0].num_blocks == 3 && out[0].unit_offset_blocks == 0);
  CHECK(out[1].first_block == 20 && out[1].num_blocks == 1 && out[1].unit_offset_blocks == 3);
  CHECK(out[2].first_block == 99 && out[3].first_block == 98);
  int64_t bad[] = {99, 100};
  out.clear();
  CHECK(m.build(bad, 2, &out).code() == Code::kLayout);
  // A retrieve's skipped blocks (-1) form runs of their own; elsewhere -1 is out of range.
  int64_t skip[] = {-1, -1, 7, 8, -1, 3};
  out.clear();
  CHECK(m.build(skip, 6, &out).code() == Code::kLayout);
  out.clear();
  CHECK(m.build(skip, 6, &out, true).ok());
  CHECK(out.size() == 4);
  CHECK(out[0].skip() && out[0].num_blocks == 2 && out[0].unit_offset_blocks == 0);
  CHECK(out[1].first_block == 7 && out[1].num_blocks == 2 && out[1].unit_offset_blocks == 2);
  CHECK(out[2].skip() && out[2].num_blocks == 1 && out[2].unit_offset_blocks == 4);
  CHECK(out[3].first_block == 3 && out[3].num_blocks == 1);
  int64_t neg[] = {-2};
  out.clear();
  CHECK(m.build(neg, 1, &out, true).code() == Code::kLayout);
  // A block named twice, in one run or in two (skips aside), is refused.
  out.clear();
  CHECK(m.build(skip, 6, &out, true).ok() && m.check_distinct(out).ok());
  int64_t twice[] = {-1, 7, 8, -1, 6, 7};
  out.clear();
  CHECK(m.build(twice, 6, &out, true).ok());
  CHECK(m.check_distinct(out).code() == Code::kLayout);
  CHECK(m.addr(1, 1, 3) == reinterpret_cast<uint8_t*>(0x100000 + 3 * 64));
}

// The copy engine's plan (copy_stage.h): units in mapped files get slots in unit order, each slot's
// source is its unit's layer-0 objects in the mapping, and an IOCTX range maps to its units' slots.
static void test_copy_stage() {
  const uint32_t opl = 2, units = 5;
  std::vector<uint8_t> file0(1 << 16), file2(1 << 16);
  const std::vector<uint8_t*> mapped = {file0.data(), nullptr, file2.data()};
  const uint32_t paths[units] = {0, 1, 2, 0, 2};  // unit 1 on an unmapped file
  std::vector<Ioctx> ctx;
  for (uint32_t u = 0; u < units; ++u)
    for (uint32_t o = 0; o < opl; ++o) {
      Ioctx x{};
      x.unit = u;
      x.obj = o;
      x.path = paths[u];
      x.slot = u == 3 ? kNoSlot : u;  // unit 3: not in the pool (a miss)
      x.file_offset = 4096ull * u;
      ctx.push_back(x);
    }
  CopyStage c;
  uint32_t slot[units];
  c.plan(ctx.data(), units, opl, mapped, 512, slot);
  CHECK(slot[0] == 0 && slot[1] == kNoCopy && slot[2] == 1 && slot[3] == kNoCopy && slot[4] == 2);
  CHECK((c.units == std::vector<uint32_t>{0, 2, 4}));
  CHECK(c.src[0] == reinterpret_cast<uint64_t>(file0.data()) + 512);
  CHECK(c.src[1] == reinterpret_cast<uint64_t>(file2.data()) + 2 * 4096 + 512);
  CHECK(c.src[2] == reinterpret_cast<uint64_t>(file2.data()) + 4 * 4096 + 512);
  uint32_t lo = 0, hi = 0;
  c.slots_of(0, units * opl, opl, &lo, &hi);  // the whole request
  CHECK(lo == 0 && hi == 3);
  c.slots_of(2, 6, opl, &lo, &hi);  // units 1-3
  CHECK(lo == 1 && hi == 2);
  c.slots_of(6, 2, opl, &lo, &hi);  // unit 3 alone: no slot
  CHECK(lo == hi);
  c.slots_of(8, 0, opl, &lo, &hi);
  CHECK(lo == hi);
}

static void test_header_round_trip() {
  LayerKV l;
  l.nptr = 2;
  l.ptr[0] = l.ptr[1] = 1;
  l.block_bytes = 32768;
  l.block_stride = 32768;
  l.num_blocks = 8;
  Geometry g;
  CHECK(make_geometry(std::vector<LayerKV>(32, l), 16, "bf16[16,8,128]x2", &g).ok());
  CHECK(g.obj_bytes == 512 * 1024 && g.num_objs() == 64 && g.header_bytes == 4096);
  // Objects of 2^70 bytes do not wrap to 0 past the size check; 2^64 - 4 byte blocks neither.
  Geometry big;
  CHECK(make_geometry(2, 2, 1ull << 40, 1u << 30, "x", &big).code() == Code::kLayout);
  CHECK(make_geometry(2, 2, ~0ull - 3, 1, "x", &big).code() == Code::kLayout);
  CHECK(make_geometry(2, 2, 4096, 1u << 30, "x", &big).code() == Code::kLayout);
  CHECK(g.slot_bytes == 4096 + 64ull * 512 * 1024);
  std::vector<uint64_t> sums(64), back(64);
  for (size_t i = 0; i < sums.size(); ++i) sums[i] = i * 7 + 1;
  std::vector<uint8_t> buf(g.header_bytes);
  encode_header(g, "bf16[16,8,128]x2", 42, 9, 16, sums.data(), buf.data());
  uint64_t key, seq;
  uint32_t blocks = 0;
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data()) == HeaderState::kValid && key == 42 &&
        seq == 9 && blocks == 16 && back == sums);
  // Every single-bit flip anywhere in the header's checked bytes (block word included) is a damaged
  // header, no header.
  const size_t checked = sizeof(HeaderFixed) + 8 + 8 * 64;
  for (size_t bit = 0; bit < 8 * checked; ++bit) {
    buf[bit / 8] ^= 1 << (bit % 8);
    CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data()) != HeaderState::kValid);
    buf[bit / 8] ^= 1 << (bit % 8);
  }
  // The key and the commit sequence, both flipped at bit 31: found by the header CRC.
  buf[offsetof(HeaderFixed, key) + 3] ^= 0x80;
  buf[offsetof(HeaderFixed, commit_seq) + 3] ^= 0x80;
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data()) == HeaderState::kCorrupt);
  std::vector<uint8_t> zero(g.header_bytes, 0);
  CHECK(decode_header(g, zero.data(), &key, &seq, &blocks, back.data()) == HeaderState::kEmpty);
  // A partial unit's block count comes back; 0 or more than unit_blocks is a damaged header even
  // under a valid header checksum.
  encode_header(g, "bf16[16,8,128]x2", 42, 9, 5, sums.data(), buf.data());
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data()) == HeaderState::kValid && blocks == 5);
  encode_header(g, "bf16[16,8,128]x2", 42, 9, 17, sums.data(), buf.data());
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data()) == HeaderState::kCorrupt);
  encode_header(g, "bf16[16,8,128]x2", 42, 9, 0, sums.data(), buf.data());
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data()) == HeaderState::kCorrupt);
  // The same checksums under another key or commit decode to other values: bound to the unit.
  encode_header(g, "bf16[16,8,128]x2", 43, 9, 16, sums.data(), buf.data());
  std::vector<uint8_t> b43 = buf;
  encode_header(g, "bf16[16,8,128]x2", 42, 9, 16, sums.data(), buf.data());
  CHECK(std::memcmp(b43.data() + sizeof(HeaderFixed) + 8, buf.data() + sizeof(HeaderFixed) + 8, 8 * 64) != 0);
  Geometry other;
  CHECK(make_geometry(std::vector<LayerKV>(32, l), 16, "fp16[16,8,128]x2", &other).ok());
  CHECK(other.layout_id != g.layout_id);
  std::string named;
  encode_header(other, "fp16[16,8,128]x2", 42, 9, 16, sums.data(), buf.data());
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data(), &named) == HeaderState::kOtherLayout);
  CHECK(named.find("fp16") == 0);
  // Format 4's inner block keys: they come back, at most blocks - 1 of them are kept, and every
  // single-bit flip in them (or in their count) is a damaged header.
  const uint64_t in[15] = {11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25};
  std::vector<uint64_t> got;
  encode_header(g, "bf16[16,8,128]x2", 42, 9, 16, sums.data(), buf.data(), in, 15);
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data(), nullptr, &got) == HeaderState::kValid &&
        blocks == 16 && got == std::vector<uint64_t>(in, in + 15));
  for (size_t bit = 0; bit < 8 * (checked + 8 * 15); ++bit) {
    buf[bit / 8] ^= 1 << (bit % 8);
    CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data(), nullptr, &got) != HeaderState::kValid);
    buf[bit / 8] ^= 1 << (bit % 8);
  }
  encode_header(g, "bf16[16,8,128]x2", 42, 9, 3, sums.data(), buf.data(), in, 15);  // a partial unit of 3
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data(), nullptr, &got) == HeaderState::kValid &&
        blocks == 3 && got == std::vector<uint64_t>(in, in + 2));
  encode_header(g, "bf16[16,8,128]x2", 42, 9, 16, sums.data(), buf.data());  // none: an empty list
  CHECK(decode_header(g, buf.data(), &key, &seq, &blocks, back.data(), nullptr, &got) == HeaderState::kValid &&
        got.empty());
  CHECK(header_inner_room(g) == (4096 - checked) / 8);
}

static std::string temp_dir() {
  char tmpl[] = "/tmp/tutti-native-XXXXXX";
  CHECK(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

// One layer of one 4 KiB object per block, one-block units: the pool tests' geometry.
static Geometry small_geometry() {
  LayerKV l;
  l.nptr = 1;
  l.ptr[0] = 1;
  l.block_bytes = l.block_stride = 4096;
  l.num_blocks = 4;
  Geometry g;
  CHECK(make_geometry({l}, 1, "x", &g).ok());
  return g;
}

static void test_pool_round_robin() {
  std::string a = temp_dir(), b = temp_dir();
  const Geometry g = small_geometry();
  FilePool p;
  CHECK(p.open({a, b}, {3 * g.slot_bytes, 3 * g.slot_bytes}, "t", g, DirectMode::kAuto, false).ok());
  CHECK(p.num_slots() == 6);
  uint32_t s[6];
  for (auto& x : s) CHECK(p.alloc(&x));
  for (int i = 0; i < 6; ++i) CHECK(p.path_of(s[i]) == static_cast<uint32_t>(i % 2));
  uint32_t extra;
  CHECK(!p.alloc(&extra));
  FilePool q;  // the same share in a second open is refused
  CHECK(q.open({a, b}, {3 * g.slot_bytes, 3 * g.slot_bytes}, "t", g, DirectMode::kAuto, false).code() == Code::kConfig);
  p.close();
  std::string cmd = "rm -rf " + a + " " + b;
  CHECK(std::system(cmd.c_str()) == 0);
}

// Slot heads go out in batches of 64 through io_uring; each lands at its slot's start.
static void test_pool_slot_heads() {
  std::string a = temp_dir();
  const Geometry g = small_geometry();
  const uint32_t n = 150;
  FilePool p;
  CHECK(p.open({a}, {n * g.slot_bytes}, "t", g, DirectMode::kAuto, false).ok());
  std::vector<uint32_t> slots(n);
  for (auto& x : slots) CHECK(p.alloc(&x));
  std::reverse(slots.begin(), slots.end());
  void* mem = nullptr;
  CHECK(posix_memalign(&mem, kAlign, (n + 1) * 4096) == 0);
  uint8_t* bufs = static_cast<uint8_t*>(mem);
  for (uint32_t i = 0; i < n * 4096; ++i) bufs[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  std::vector<uint8_t> ok(n);
  p.write_slot_heads(slots.data(), bufs, 4096, n, ok.data());
  uint8_t* back = bufs + n * 4096;
  for (uint32_t i = 0; i < n; ++i) {
    CHECK(ok[i] == 1);
    CHECK(p.pread_all(slots[i], 0, back, 4096).ok());
    CHECK(std::memcmp(back, bufs + i * 4096, 4096) == 0);
  }
  if (p.path(0).direct) {  // a length O_DIRECT refuses: reported not written, by io_uring and pwrite alike
    p.write_slot_heads(slots.data(), bufs, 100, 3, ok.data());
    CHECK(ok[0] == 0 && ok[1] == 0 && ok[2] == 0);
  }
  std::free(mem);
  p.close();
  std::string cmd = "rm -rf " + a;
  CHECK(std::system(cmd.c_str()) == 0);
}

static std::string read_all(const std::string& file) {
  std::string out;
  if (FILE* f = std::fopen(file.c_str(), "rb")) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
    std::fclose(f);
  }
  return out;
}

static void write_all(const std::string& file, const std::string& data) {
  FILE* f = std::fopen(file.c_str(), "wb");
  CHECK(f != nullptr);
  CHECK(std::fwrite(data.data(), 1, data.size(), f) == data.size());
  std::fclose(f);
}

// A writer takes only files of its own: a symbolic link, a foreign file or a FIFO at a pool's name
// is refused (StorageError) and left as it was; new files are owner-only whatever the umask, begin
// with the layout's free-slot header and open again; a file this open made is removed when it fails.
static void test_pool_files_are_trusted_only_when_ours() {
  std::string a = temp_dir();
  const Geometry g = small_geometry();
  const std::string pool = a + "/tutti-t.pool", victim = a + "/victim";
  PoolFileOptions stamped;
  stamped.stamp = true;
  stamped.desc = "x";
  write_all(victim, "precious bytes");
  CHECK(::symlink(victim.c_str(), pool.c_str()) == 0);
  FilePool p;
  Status s = p.open({a}, {4 * g.slot_bytes}, "t", g, DirectMode::kAuto, false, 1, false, stamped);
  CHECK(s.code() == Code::kStorage && s.message().find("symbolic link") != std::string::npos);
  CHECK(read_all(victim) == "precious bytes");
  s = p.open({a}, {4 * g.slot_bytes}, "t", g, DirectMode::kAuto, true);  // readers refuse it as well
  CHECK(s.code() == Code::kStorage && s.message().find("symbolic link") != std::string::npos);
  CHECK(::unlink(pool.c_str()) == 0);
  write_all(pool, "not a pool");
  s = p.open({a}, {4 * g.slot_bytes}, "t", g, DirectMode::kAuto, false, 1, false, stamped);
  CHECK(s.code() == Code::kStorage && s.message().find("non-empty file of 10 bytes") != std::string::npos);
  CHECK(read_all(pool) == "not a pool");
  CHECK(::unlink(pool.c_str()) == 0);
  CHECK(::mkfifo(pool.c_str(), 0600) == 0);
  s = p.open({a}, {4 * g.slot_bytes}, "t", g, DirectMode::kAuto, false, 1, false, stamped);
  CHECK(s.code() == Code::kStorage && s.message().find("FIFO") != std::string::npos);
  s = p.open({a}, {4 * g.slot_bytes}, "t", g, DirectMode::kAuto, true);  // no wait for a writer
  CHECK(s.code() == Code::kStorage && s.message().find("FIFO") != std::string::npos);
  CHECK(::unlink(pool.c_str()) == 0);
  const mode_t old_mask = ::umask(0);
  s = p.open({a}, {4 * g.slot_bytes}, "t", g, DirectMode::kAuto, false, 1, false, stamped);
  ::umask(old_mask);
  CHECK(s.ok());
  struct stat st;
  CHECK(::stat(pool.c_str(), &st) == 0 && (st.st_mode & 07777) == 0600 && st.st_size == static_cast<off_t>(4 * g.slot_bytes));
  p.close();
  uint64_t magic = 0;
  std::memcpy(&magic, read_all(pool).data(), sizeof(magic));
  CHECK(magic == kHeaderMagic);
  CHECK(::chmod(pool.c_str(), 0644) == 0);  // as an older build made them: tightened at the next open
  CHECK(p.open({a}, {4 * g.slot_bytes}, "t", g, DirectMode::kAuto, false, 1, false, stamped).ok());
  CHECK(::stat(pool.c_str(), &st) == 0 && (st.st_mode & 07777) == 0600);
  p.close();
  CHECK(::link(pool.c_str(), (a + "/second-name").c_str()) == 0);
  s = p.open({a}, {4 * g.slot_bytes}, "t", g, DirectMode::kAuto, false, 1, false, stamped);
  CHECK(s.code() == Code::kStorage && s.message().find("2 hard links") != std::string::npos);
  CHECK(::unlink((a + "/second-name").c_str()) == 0);
  // A file that cannot be preallocated (past any file size) is removed again when this open made it.
  FilePool q;
  s = q.open({a}, {1ull << 62}, "big", g, DirectMode::kAuto, false, 1, false, stamped);
  CHECK(!s.ok());
  CHECK(::access((a + "/tutti-big.pool").c_str(), F_OK) != 0);
  std::string cmd = "rm -rf " + a;
  CHECK(std::system(cmd.c_str()) == 0);
}

static void test_store_round_trip_with_random_blocks() {
  std::string dir = temp_dir();
  const uint32_t layers = 3, blocks = 64, unit_blocks = 4;
  const uint64_t bb = 4096;
  std::vector<std::vector<uint8_t>> kv(layers * 2, std::vector<uint8_t>(blocks * bb));
  std::mt19937_64 rng(3);
  for (auto& t : kv)
    for (auto& x : t) x = static_cast<uint8_t>(rng());
  std::vector<LayerKV> ls(layers);
  for (uint32_t i = 0; i < layers; ++i) {
    ls[i].nptr = 2;
    ls[i].ptr[0] = reinterpret_cast<uint64_t>(kv[2 * i].data());
    ls[i].ptr[1] = reinterpret_cast<uint64_t>(kv[2 * i + 1].data());
    ls[i].block_bytes = ls[i].block_stride = bb;
    ls[i].num_blocks = blocks;
  }
  StoreOptions o;
  o.paths = {dir};
  o.capacity = {64ull << 20};
  o.instance = "t";
  o.unit_blocks = unit_blocks;
  o.staging_mb = 1;
  std::unique_ptr<Store> s;
  CHECK(Store::open(o, ls, "u8", &s).ok());
  CHECK(s->init_queue(64).ok());
  std::vector<int64_t> ids(blocks);
  for (uint32_t i = 0; i < blocks; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<uint64_t> keys = {11, 12, 13, 14};
  uint32_t req;
  RequestResult r;
  CHECK(s->begin(ReqOp::kStore, keys.data(), 4, ids.data(), 16, &req).ok());
  for (uint32_t l = 0; l < layers; ++l) CHECK(s->layer(l, req, 0).ok());
  CHECK(s->finish(req, &r).ok() && r.failed_units.empty() && r.committed_units.size() == 4);
  auto want = kv;
  for (auto& t : kv) std::memset(t.data(), 0, t.size());
  CHECK(s->begin(ReqOp::kRetrieve, keys.data(), 4, ids.data() + 16, 16, &req).ok());
  for (uint32_t l = 0; l < layers; ++l) CHECK(s->layer(l, req, 0).ok());
  CHECK(s->finish(req, &r).ok() && r.failed_units.empty());
  for (uint32_t t = 0; t < kv.size(); ++t)
    for (uint32_t i = 0; i < 16; ++i)
      CHECK(std::memcmp(want[t].data() + ids[i] * bb, kv[t].data() + ids[16 + i] * bb, bb) == 0);
  s.reset();
  std::string cmd = "rm -rf " + dir;
  CHECK(std::system(cmd.c_str()) == 0);
}

int main() {
  run("ring_spsc_threads", test_ring_spsc_threads);
  run("crc32c_values_and_pieces", test_crc32c_values_and_pieces);
  run("crc32c_lane_scheme", test_crc32c_lane_scheme);
  run("index_lru_and_pins", test_index_lru_and_pins);
  run("index_tiers", test_index_tiers);
  run("extents", test_extents);
  run("copy_stage", test_copy_stage);
  run("header_round_trip", test_header_round_trip);
  run("pool_round_robin", test_pool_round_robin);
  run("pool_slot_heads", test_pool_slot_heads);
  run("pool_files_are_trusted_only_when_ours", test_pool_files_are_trusted_only_when_ours);
  run("store_round_trip_with_random_blocks", test_store_round_trip_with_random_blocks);
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail == 0 ? 0 : 1;
}
