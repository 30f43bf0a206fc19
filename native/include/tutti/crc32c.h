// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the object and header checksum.
//
// Why CRC32C: its Hamming distance is at least 4 for messages up to 2^31 - 1 bits, so every error of
// up to 3 bits in an object below 256 MiB is detected, and, like every CRC of degree 32, it detects
// every burst of up to 32 bits. x86 computes it in hardware (SSE4.2), and it is affine in the
// bytes, so pieces summed apart combine exactly: the I/O kernel's lanes each sum their own words
// and one shift per lane joins them (see the lane scheme below).
//
// Two forms of the state appear here:
// - a CRC value, as crc32c_extend returns (initial value and final xor ~0: the standard CRC32C);
// - a raw register (initial value 0, no final xor), which is what the lane scheme and the shift
//   tables work on. For a message M, crc32c(M) = raw(M) ^ crc32c_zeros_xor(|M|).
//
// The lane scheme (CUDA kernel, and its host model in the native tests): a warp of 32 lanes walks an
// object in 16-byte vectors (or 4-byte words), lane l taking every vector whose index is l mod 32,
// in order. Each lane keeps a raw register acc over "its" vectors with the bytes of the other lanes
// as zeros: acc <- shift_512(acc) ^ raw(v) (shift_128 for words). The object's raw register is then
// the xor over lanes of shift_{16 (31 - l)}(acc_l) (4 (31 - l) for words), when the object is a
// whole number of 512-byte (128-byte) strides, as every 4 KiB-aligned object is.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define TUTTI_HD __host__ __device__ __forceinline__
#else
#define TUTTI_HD inline
#endif

namespace tutti {

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;

// Table rows used by the lane scheme: T_k[b] is the raw register after byte b followed by k zero
// bytes. Rows 0-15: T_0..T_15; rows 16-19: T_508..T_511; rows 20-23: T_124..T_127.
constexpr uint32_t kCrcRows = 24;
struct CrcLaneTables {
  uint32_t t[kCrcRows][256];
  uint32_t lane_shift16[32];  // x^(8 * 16 * (31 - l)) mod P: joins lane l's register (vectors)
  uint32_t lane_shift4[32];   // x^(8 * 4 * (31 - l)) mod P: the same for 4-byte words
};
// Fills the tables (host, once).
void crc32c_lane_tables(CrcLaneTables* out);

// a(x) * b(x) mod P, reflected (bit 31 is x^0). Shifting a raw register r over n zero bytes is
// crc32c_multmodp(crc32c_x8n(n), r).
TUTTI_HD uint32_t crc32c_multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ kCrc32cPoly : b >> 1;
  }
  return p;
}
// x^(8 n) mod P (host).
uint32_t crc32c_x8n(uint64_t n);
// The xor that turns the raw register of an n-byte message into its CRC32C value (host).
uint32_t crc32c_zeros_xor(uint64_t n);

// The lane scheme's lookups, from one of two forms of the rows:
// - byte rows, `const uint32_t (*)[256]`: T_k[b] itself, one lookup per byte;
// - nibble rows, `const uint32_t (*)[16]`: row 2r holds T_r of the low nibble, row 2r + 1 of the
//   high nibble (T_r[b] = N_2r[b & 15] ^ N_2r+1[b >> 4], the register being linear in the bytes).
//   Twice the lookups, but the 32 lanes of a warp looking up one 16-entry row hit distinct
//   shared-memory banks, where random bytes into a 256-entry row collide about 3.5-fold.
TUTTI_HD uint32_t crc_row(const uint32_t (*t)[256], uint32_t r, uint32_t b) { return t[r][b & 0xff]; }
TUTTI_HD uint32_t crc_row(const uint32_t (*n)[16], uint32_t r, uint32_t b) {
  return n[2 * r][b & 15] ^ n[2 * r + 1][(b >> 4) & 15];
}
// Entry i of the nibble rows (row i / 16, nibble i % 16) from the byte rows.
TUTTI_HD uint32_t crc_nibble_entry(const uint32_t (*t)[256], uint32_t i) {
  const uint32_t row = i / 16, x = i % 16;
  return t[row / 2][row % 2 ? x << 4 : x];
}
// The shift of a register over 512 (rows 16-19) or 128 (rows 20-23) bytes.
template <typename Rows>
TUTTI_HD uint32_t crc_lane_shift(Rows t, uint32_t r0, uint32_t acc) {
  return crc_row(t, r0 + 3, acc) ^ crc_row(t, r0 + 2, acc >> 8) ^ crc_row(t, r0 + 1, acc >> 16) ^ crc_row(t, r0, acc >> 24);
}
// The raw register of word w followed by `after` zero bytes (rows after..after + 3).
template <typename Rows>
TUTTI_HD uint32_t crc_lane_word(Rows t, uint32_t after, uint32_t w) {
  return crc_row(t, after + 3, w) ^ crc_row(t, after + 2, w >> 8) ^ crc_row(t, after + 1, w >> 16) ^ crc_row(t, after, w >> 24);
}
// One lane step over a 16-byte vector (words w0..w3, little-endian) 512 bytes after the lane's last.
template <typename Rows>
TUTTI_HD uint32_t crc_lane_step16(Rows t, uint32_t acc, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  return crc_lane_shift(t, 16, acc) ^ crc_lane_word(t, 12, w0) ^ crc_lane_word(t, 8, w1) ^ crc_lane_word(t, 4, w2) ^
         crc_lane_word(t, 0, w3);
}
// A vector of zeros: only the shift.
template <typename Rows>
TUTTI_HD uint32_t crc_lane_skip16(Rows t, uint32_t acc) { return crc_lane_shift(t, 16, acc); }
// One lane step over a 4-byte word 128 bytes after the lane's last.
template <typename Rows>
TUTTI_HD uint32_t crc_lane_step4(Rows t, uint32_t acc, uint32_t w) { return crc_lane_shift(t, 20, acc) ^ crc_lane_word(t, 0, w); }
template <typename Rows>
TUTTI_HD uint32_t crc_lane_skip4(Rows t, uint32_t acc) { return crc_lane_shift(t, 20, acc); }
// Standard CRC32C of `n` bytes continuing from `crc` (0 to start): crc32c_extend(crc32c_extend(0, A),
// B) is the CRC32C of A followed by B. Hardware CRC32 instructions where the CPU has them.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
// Copies `n` bytes from `src` to `dst` and extends `crc` over them, in one pass.
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n);
// The same with streaming (non-temporal) stores where the CPU and the destination allow (AVX-512,
// `dst` 64-byte aligned, n >= 512; else as crc32c_copy), for a destination that is not read again
// soon (KV blocks being restored, a pool file's mapping): the copy skips reading each destination
// line in before writing it and leaves the caches to the caller's other work. The stores are
// fenced before it returns.
uint32_t crc32c_copy_stream(uint32_t crc, void* dst, const void* src, size_t n);

}  // namespace tutti
