// Copy-and-checksum bandwidth of one core: CRC32C (this build's fastest path), the same with
// streaming stores into a 64-byte aligned destination (what a retrieve writes KV blocks with), plain
// memcpy, and format 1's two position-weighted sums (kept here only as the baseline), in cache and
// from DRAM.
// Usage: crc_bandwidth [GiB per size, default 2]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tutti/crc32c.h"

using namespace tutti;

namespace {

// Format 1's checksum with its copy, as common.cc had it (vectorised by the compiler).
__attribute__((target_clones("avx2", "default"))) uint64_t sums_copy(void* dst, const void* src, size_t n) {
  const uint32_t* __restrict s = static_cast<const uint32_t*>(src);
  uint32_t* __restrict d = static_cast<uint32_t*>(dst);
  uint32_t lo = 0, hi = 0;
  for (size_t i = 0; i < n / 4; ++i) {
    const uint32_t w = s[i];
    d[i] = w;
    lo += w;
    hi += w * (2u * static_cast<uint32_t>(i) + 1u);
  }
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

template <typename F>
double gbps(size_t n, double gib, F f) {
  const int reps = static_cast<int>(gib * (1ull << 30) / n) + 1;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) f();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(n) * reps / 1e9 / s;
}

}  // namespace

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 2.0;
  std::printf("%10s %12s %16s %18s %12s %18s\n", "size", "crc32c", "crc32c+copy", "crc32c+stream copy", "memcpy",
              "format-1 sums+copy");
  for (size_t n : {size_t(32) << 10, size_t(1) << 20, size_t(256) << 20}) {
    std::vector<uint8_t> a(n), b(n + 64);
    uint8_t* const b64 = b.data() + (64 - reinterpret_cast<uintptr_t>(b.data()) % 64) % 64;
    for (size_t i = 0; i < n; ++i) a[i] = static_cast<uint8_t>(i * 131 + 7);
    volatile uint64_t sink = 0;
    const double c = gbps(n, gib, [&] { sink = sink + crc32c_extend(0, a.data(), n); });
    const double cc = gbps(n, gib, [&] { sink = sink + crc32c_copy(0, b.data(), a.data(), n); });
    const double cs = gbps(n, gib, [&] { sink = sink + crc32c_copy_stream(0, b64, a.data(), n); });
    const double m = gbps(n, gib, [&] { std::memcpy(b.data(), a.data(), n); sink = sink + b[n / 2]; });
    const double s = gbps(n, gib, [&] { sink = sink + sums_copy(b.data(), a.data(), n); });
    std::printf("%7zu KiB %9.1f GB/s %13.1f GB/s %15.1f GB/s %9.1f GB/s %15.1f GB/s\n", n >> 10, c, cc, cs, m, s);
  }
  return 0;
}
