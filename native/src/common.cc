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

}  // namespace tutti
