#include "tutti/common.h"

#include <cstring>

namespace tutti {

std::string errno_message(const std::string& what, int err) { return what + ": " + std::strerror(err); }

// Built twice: AVX2 where the CPU has it (8 lanes of 32-bit multiplies), SSE2 elsewhere.
__attribute__((target_clones("avx2", "default"))) uint64_t checksum(const void* data, size_t n, uint64_t first_word) {
  const uint32_t* w = static_cast<const uint32_t*>(data);
  const size_t words = n / 4;
  // Plain loops over 32-bit lanes: the compiler vectorises both sums.
  uint32_t lo = 0, hi = 0;
  uint32_t weight = static_cast<uint32_t>(2 * first_word + 1);
  for (size_t i = 0; i < words; ++i) {
    lo += w[i];
    hi += w[i] * (weight + 2u * static_cast<uint32_t>(i));
  }
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

__attribute__((target_clones("avx2", "default"))) uint64_t checksum_copy(void* dst, const void* src, size_t n,
                                                                        uint64_t first_word) {
  const uint32_t* __restrict s = static_cast<const uint32_t*>(src);
  uint32_t* __restrict d = static_cast<uint32_t*>(dst);
  const size_t words = n / 4;
  uint32_t lo = 0, hi = 0;
  uint32_t weight = static_cast<uint32_t>(2 * first_word + 1);
  for (size_t i = 0; i < words; ++i) {
    const uint32_t w = s[i];
    d[i] = w;
    lo += w;
    hi += w * (weight + 2u * static_cast<uint32_t>(i));
  }
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

}  // namespace tutti
