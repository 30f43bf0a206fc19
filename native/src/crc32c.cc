#include "tutti/crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace tutti {

namespace {

// T_0: the raw register after one byte.
struct ByteTable {
  uint32_t t[256];
  ByteTable() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t[b] = c;
    }
  }
};
const ByteTable& byte_table() {
  static const ByteTable t;
  return t;
}

// Row T_k of the lane tables: byte b followed by k zero bytes.
void fill_row(uint32_t k, uint32_t* row) {
  const uint32_t op = crc32c_x8n(k);
  for (uint32_t b = 0; b < 256; ++b) row[b] = crc32c_multmodp(op, byte_table().t[b]);
}

// Shift of a raw register over a fixed number of zero bytes, as four table lookups.
struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(uint32_t n) {
    for (uint32_t k = 0; k < 4; ++k) fill_row(n - 1 - k, t[k]);
  }
  uint32_t operator()(uint32_t r) const {
    return t[0][r & 0xff] ^ t[1][(r >> 8) & 0xff] ^ t[2][(r >> 16) & 0xff] ^ t[3][r >> 24];
  }
};

// Portable path: slicing by 8.
struct Slice8 {
  uint32_t t[8][256];
  Slice8() {
    for (uint32_t k = 0; k < 8; ++k) fill_row(k, t[k]);
  }
};
const Slice8& slice8() {
  static const Slice8 s;
  return s;
}

uint32_t raw_portable(uint32_t r, const uint8_t* p, size_t n) {
  const auto& t = slice8().t;
  while (n >= 8) {
    uint32_t a, b;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    a ^= r;
    r = t[7][a & 0xff] ^ t[6][(a >> 8) & 0xff] ^ t[5][(a >> 16) & 0xff] ^ t[4][a >> 24] ^ t[3][b & 0xff] ^
        t[2][(b >> 8) & 0xff] ^ t[1][(b >> 16) & 0xff] ^ t[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) r = (r >> 8) ^ t[0][(r ^ *p++) & 0xff];
  return r;
}

uint32_t raw_copy_portable(uint32_t r, uint8_t* d, const uint8_t* s, size_t n) {
  std::memcpy(d, s, n);
  return raw_portable(r, s, n);
}

#if defined(__x86_64__)
// Three independent streams over thirds of each 3 x kStripe bytes keep the CRC32 unit busy (latency
// 3, throughput 1); the partial registers are joined with two table shifts.
constexpr size_t kStripe = 1024;
const ShiftTable& shift1() {
  static const ShiftTable s(kStripe);
  return s;
}
const ShiftTable& shift2() {
  static const ShiftTable s(2 * kStripe);
  return s;
}

template <bool kCopy>
__attribute__((target("sse4.2"))) uint32_t raw_hw(uint32_t r, uint8_t* d, const uint8_t* s, size_t n) {
  const ShiftTable& s1 = shift1();
  const ShiftTable& s2 = shift2();
  uint64_t a = r;
  while (n >= 3 * kStripe) {
    uint64_t b = 0, c = 0;
    for (size_t i = 0; i < kStripe; i += 8) {
      uint64_t x, y, z;
      std::memcpy(&x, s + i, 8);
      std::memcpy(&y, s + kStripe + i, 8);
      std::memcpy(&z, s + 2 * kStripe + i, 8);
      if (kCopy) {
        std::memcpy(d + i, &x, 8);
        std::memcpy(d + kStripe + i, &y, 8);
        std::memcpy(d + 2 * kStripe + i, &z, 8);
      }
      a = _mm_crc32_u64(a, x);
      b = _mm_crc32_u64(b, y);
      c = _mm_crc32_u64(c, z);
    }
    a = s2(static_cast<uint32_t>(a)) ^ s1(static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(c);
    s += 3 * kStripe;
    if (kCopy) d += 3 * kStripe;
    n -= 3 * kStripe;
  }
  for (; n >= 8; n -= 8, s += 8) {
    uint64_t x;
    std::memcpy(&x, s, 8);
    if (kCopy) {
      std::memcpy(d, &x, 8);
      d += 8;
    }
    a = _mm_crc32_u64(a, x);
  }
  uint32_t r32 = static_cast<uint32_t>(a);
  for (; n; --n) {
    if (kCopy) *d++ = *s;
    r32 = _mm_crc32_u8(r32, *s++);
  }
  return r32;
}

bool has_hw() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

uint32_t raw_update(uint32_t r, const void* data, size_t n) {
#if defined(__x86_64__)
  if (has_hw()) return raw_hw<false>(r, nullptr, static_cast<const uint8_t*>(data), n);
#endif
  return raw_portable(r, static_cast<const uint8_t*>(data), n);
}

uint32_t raw_copy(uint32_t r, void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (has_hw()) return raw_hw<true>(r, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
#endif
  return raw_copy_portable(r, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
}

}  // namespace

uint32_t crc32c_x8n(uint64_t n) {
  // x^(2^k) mod P for k = 0..63, then x^(8 n) = product over the set bits of 8 n.
  static const struct Powers {
    uint32_t p[64];
    Powers() {
      p[0] = 1u << 30;  // x^1
      for (int k = 1; k < 64; ++k) p[k] = crc32c_multmodp(p[k - 1], p[k - 1]);
    }
  } pw;
  uint32_t r = 1u << 31;  // x^0
  const uint64_t e = 8 * n;
  for (int k = 0; k < 61; ++k)
    if (e >> k & 1) r = crc32c_multmodp(pw.p[k], r);
  return r;
}

uint32_t crc32c_zeros_xor(uint64_t n) { return ~crc32c_multmodp(crc32c_x8n(n), 0xffffffffu); }

void crc32c_lane_tables(CrcLaneTables* out) {
  for (uint32_t k = 0; k < 16; ++k) fill_row(k, out->t[k]);
  for (uint32_t k = 0; k < 4; ++k) fill_row(508 + k, out->t[16 + k]);
  for (uint32_t k = 0; k < 4; ++k) fill_row(124 + k, out->t[20 + k]);
  for (uint32_t l = 0; l < 32; ++l) {
    out->lane_shift16[l] = crc32c_x8n(16ull * (31 - l));
    out->lane_shift4[l] = crc32c_x8n(4ull * (31 - l));
  }
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) { return ~raw_update(~crc, data, n); }

uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n) { return ~raw_copy(~crc, dst, src, n); }

}  // namespace tutti
