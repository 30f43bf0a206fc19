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

// One lane step over a 16-byte vector (words w0..w3, little-endian) 512 bytes after the lane's last.
TUTTI_HD uint32_t crc_lane_step16(const uint32_t (*t)[256], uint32_t acc, uint32_t w0, uint32_t w1, uint32_t w2,
                                  uint32_t w3) {
  return t[19][acc & 0xff] ^ t[18][(acc >> 8) & 0xff] ^ t[17][(acc >> 16) & 0xff] ^ t[16][acc >> 24] ^
         t[15][w0 & 0xff] ^ t[14][(w0 >> 8) & 0xff] ^ t[13][(w0 >> 16) & 0xff] ^ t[12][w0 >> 24] ^
         t[11][w1 & 0xff] ^ t[10][(w1 >> 8) & 0xff] ^ t[9][(w1 >> 16) & 0xff] ^ t[8][w1 >> 24] ^
         t[7][w2 & 0xff] ^ t[6][(w2 >> 8) & 0xff] ^ t[5][(w2 >> 16) & 0xff] ^ t[4][w2 >> 24] ^
         t[3][w3 & 0xff] ^ t[2][(w3 >> 8) & 0xff] ^ t[1][(w3 >> 16) & 0xff] ^ t[0][w3 >> 24];
}
// A vector of zeros: only the shift.
TUTTI_HD uint32_t crc_lane_skip16(const uint32_t (*t)[256], uint32_t acc) {
  return t[19][acc & 0xff] ^ t[18][(acc >> 8) & 0xff] ^ t[17][(acc >> 16) & 0xff] ^ t[16][acc >> 24];
}
// One lane step over a 4-byte word 128 bytes after the lane's last.
TUTTI_HD uint32_t crc_lane_step4(const uint32_t (*t)[256], uint32_t acc, uint32_t w) {
  return t[23][acc & 0xff] ^ t[22][(acc >> 8) & 0xff] ^ t[21][(acc >> 16) & 0xff] ^ t[20][acc >> 24] ^
         t[3][w & 0xff] ^ t[2][(w >> 8) & 0xff] ^ t[1][(w >> 16) & 0xff] ^ t[0][w >> 24];
}
TUTTI_HD uint32_t crc_lane_skip4(const uint32_t (*t)[256], uint32_t acc) {
  return t[23][acc & 0xff] ^ t[22][(acc >> 8) & 0xff] ^ t[21][(acc >> 16) & 0xff] ^ t[20][acc >> 24];
}

// Standard CRC32C of `n` bytes continuing from `crc` (0 to start): crc32c_extend(crc32c_extend(0, A),
// B) is the CRC32C of A followed by B. Hardware CRC32 instructions where the CPU has them.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
// Copies `n` bytes from `src` to `dst` and extends `crc` over them, in one pass.
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n);

}  // namespace tutti
