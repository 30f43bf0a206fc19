#include "tutti/crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
// The AVX-512 helpers below are internal and inlined into functions built for AVX-512: no ABI edge.
// GCC 12's _mm512_extracti32x4_epi32 passes an undefined vector it never uses (the mask is full).
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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

// x^e mod P, reflected: the product of the cached x^(2^k) over the set bits of e.
uint32_t x_pow(uint64_t e) {
  static const struct Powers {
    uint32_t p[64];
    Powers() {
      p[0] = 1u << 30;  // x^1
      for (int k = 1; k < 64; ++k) p[k] = crc32c_multmodp(p[k - 1], p[k - 1]);
    }
  } pw;
  uint32_t r = 1u << 31;  // x^0
  for (int k = 0; k < 64; ++k)
    if (e >> k & 1) r = crc32c_multmodp(pw.p[k], r);
  return r;
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
  if (n) std::memcpy(d, s, n);
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

// Carry-less multiplication (AVX-512 VPCLMULQDQ): sixteen 16-byte accumulators, four per 64-byte
// register, each folded forward 256 bytes per step. A 16-byte chunk S = A x^64 + B (A: its first 8
// bytes, reflected) moves forward by F bits as A (x^(64+F-1) mod P) + B (x^(F-1) mod P): the
// product of two reflected 64-bit operands comes out one bit short, which the -1 makes up. The last
// 16 bytes of folded state T give the raw register as T x^32 mod P: the CRC32 instruction over T.
bool has_vpclmul() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") && has_hw();
  return yes;
}

// The pair of folding constants for a distance of `bytes`, as one 128-bit value: low for A, high for B.
struct FoldKey {
  uint64_t a, b;
  explicit FoldKey(uint64_t bytes)
      : a(static_cast<uint64_t>(x_pow(64 + 8 * bytes - 1)) << 32), b(static_cast<uint64_t>(x_pow(8 * bytes - 1)) << 32) {}
};

__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"))) inline __m128i fold128(__m128i x, const FoldKey& k,
                                                                                            __m128i y) {
  const __m128i key = _mm_set_epi64x(static_cast<long long>(k.b), static_cast<long long>(k.a));
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, key, 0x00), _mm_clmulepi64_si128(x, key, 0x11)), y);
}

__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"))) inline __m512i fold512(__m512i x, __m512i key,
                                                                                            __m512i y) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, key, 0x00), _mm512_clmulepi64_epi128(x, key, 0x11), y,
                                   0x96);  // a ^ b ^ c
}

__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"))) inline __m512i bcast(const FoldKey& k) {
  const long long a = static_cast<long long>(k.a), b = static_cast<long long>(k.b);
  return _mm512_set_epi64(b, a, b, a, b, a, b, a);
}

template <bool kStream>
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"))) inline void store512(uint8_t* d, __m512i v) {
  if (kStream)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), v);
  else
    _mm512_storeu_si512(d, v);
}

// kStream: the copy's stores are non-temporal (the destination 64-byte aligned): written around
// the caches, without first reading each destination line in (read for ownership); the caller
// fences.
template <bool kCopy, bool kStream = false>
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"))) uint32_t raw_vpclmul(uint32_t r, uint8_t* d,
                                                                                          const uint8_t* s, size_t n) {
  static const FoldKey k256(256), k192(192), k128(128), k64(64), k48(48), k32(32), k16(16);
  __m512i x[4];
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_loadu_si512(s + 64 * i);
    if (kCopy) store512<kStream>(d + 64 * i, x[i]);
  }
  x[0] = _mm512_xor_si512(x[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(r))));
  s += 256;
  if (kCopy) d += 256;
  n -= 256;
  const __m512i key = bcast(k256);
  for (; n >= 256; n -= 256, s += 256) {
    for (int i = 0; i < 4; ++i) {
      const __m512i y = _mm512_loadu_si512(s + 64 * i);
      if (kCopy) store512<kStream>(d + 64 * i, y);
      x[i] = fold512(x[i], key, y);
    }
    if (kCopy) d += 256;
  }
  // Four registers onto the last: 192, 128 and 64 bytes forward; then its four chunks onto the last.
  __m512i z = fold512(x[0], bcast(k192), x[3]);
  z = fold512(x[1], bcast(k128), z);
  z = fold512(x[2], bcast(k64), z);
  __m128i t = _mm512_extracti32x4_epi32(z, 3);
  t = fold128(_mm512_extracti32x4_epi32(z, 0), k48, t);
  t = fold128(_mm512_extracti32x4_epi32(z, 1), k32, t);
  t = fold128(_mm512_extracti32x4_epi32(z, 2), k16, t);
  uint64_t reg = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(t)));
  reg = _mm_crc32_u64(reg, static_cast<uint64_t>(_mm_extract_epi64(t, 1)));
  return raw_hw<kCopy>(static_cast<uint32_t>(reg), d, s, n);
}
#endif

uint32_t raw_update(uint32_t r, const void* data, size_t n) {
#if defined(__x86_64__)
  if (n >= 512 && has_vpclmul()) return raw_vpclmul<false>(r, nullptr, static_cast<const uint8_t*>(data), n);
  if (has_hw()) return raw_hw<false>(r, nullptr, static_cast<const uint8_t*>(data), n);
#endif
  return raw_portable(r, static_cast<const uint8_t*>(data), n);
}

uint32_t raw_copy(uint32_t r, void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n >= 512 && has_vpclmul())
    return raw_vpclmul<true>(r, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
  if (has_hw()) return raw_hw<true>(r, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
#endif
  return raw_copy_portable(r, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
}

uint32_t raw_copy_stream(uint32_t r, void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n >= 512 && reinterpret_cast<uintptr_t>(dst) % 64 == 0 && has_vpclmul()) {
    r = raw_vpclmul<true, true>(r, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
    _mm_sfence();  // the streamed stores are ordered before whatever publishes the copy
    return r;
  }
#endif
  return raw_copy(r, dst, src, n);
}

}  // namespace

uint32_t crc32c_x8n(uint64_t n) { return x_pow(8 * n); }

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

uint32_t crc32c_copy_stream(uint32_t crc, void* dst, const void* src, size_t n) {
  return ~raw_copy_stream(~crc, dst, src, n);
}

}  // namespace tutti
