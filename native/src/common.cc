#include "tutti/common.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace tutti {

std::string errno_message(const std::string& what, int err) { return what + ": " + std::strerror(err); }

Status map_host(uint64_t bytes, void** ptr) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return {Code::kCapacityExceeded, errno_message("mmap host memory", errno)};
  madvise(p, bytes, MADV_HUGEPAGE);  // a hint: refused where THP is off
  std::memset(p, 0, bytes);          // populate now, never on the data path
  *ptr = p;
  return Status::Ok();
}

void unmap_host(void* ptr, uint64_t bytes) { munmap(ptr, bytes); }

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
