// Index cost at engine-block granularity: memory per million cache units and the time of a prefix
// lookup of a 640K-token prompt in 16-token units (40,960 keys), all hits. A benchmark, not a test:
//   ./index_bench [units (default 1000000)] [prefix keys (default 40960)] [rounds (default 20)]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "index.h"

namespace {

long resident_bytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  std::fclose(f);
  return resident * 4096;
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t units = argc > 1 ? static_cast<uint32_t>(std::atol(argv[1])) : 1000000;
  const uint32_t prefix = argc > 2 ? static_cast<uint32_t>(std::atol(argv[2])) : 40960;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 20;
  if (prefix > units) {
    std::fprintf(stderr, "the prefix (%u keys) must not exceed the units (%u)\n", prefix, units);
    return 2;
  }
  std::mt19937_64 rng(1);
  std::vector<uint64_t> keys(units);
  for (auto& k : keys) k = rng();
  const long before = resident_bytes();
  tutti::Index index;
  for (uint32_t i = 0; i < units; ++i) index.insert(keys[i], i, 16);
  const long after = resident_bytes();
  std::vector<double> us;
  for (int r = 0; r < rounds; ++r) {
    const uint32_t first = static_cast<uint32_t>(rng() % (units - prefix + 1));
    const auto t0 = std::chrono::steady_clock::now();
    const uint32_t hit = index.lookup_prefix(keys.data() + first, prefix);
    const auto t1 = std::chrono::steady_clock::now();
    if (hit != prefix) {
      std::fprintf(stderr, "lookup found %u of %u\n", hit, prefix);
      return 1;
    }
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(us.begin(), us.end());
  std::printf("index: %u units, %.1f bytes each (resident memory grew %.1f MiB)\n", units,
              static_cast<double>(after - before) / units, (after - before) / 1048576.0);
  std::printf("lookup_prefix of %u keys, all hits: median %.0f us (%.1f ns per key), min %.0f, max %.0f, %d rounds\n",
              prefix, us[us.size() / 2], us[us.size() / 2] * 1e3 / prefix, us.front(), us.back(), rounds);
  return 0;
}
