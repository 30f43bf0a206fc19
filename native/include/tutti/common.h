// Shared basics of the Tutti native core: status values and alignment helpers (the checksum is in
// crc32c.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace tutti {

// Error kinds; the bindings map each one onto one Python exception class.
enum class Code : int {
  kOk = 0,
  kNotFound,          // unknown key or object
  kCapacityExceeded,  // pool, staging or IOCB table full
  kStorage,           // I/O failure, missing or read-only directory, ENOSPC
  kDevice,            // device backend failure
  kConfig,            // bad configuration
  kLayout,            // wrong shape, dtype, layout or block id
  kInvalid,           // other bad argument
};

// A status with a message: the error channel inside the core.
class Status {
 public:
  Status() = default;
  Status(Code code, std::string msg) : code_(code), msg_(std::move(msg)) {}
  static Status Ok() { return {}; }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }

 private:
  Code code_ = Code::kOk;
  std::string msg_;
};

// Thrown only at API edges (the store facade); the bindings translate it.
struct Error {
  Status status;
};

inline void check(const Status& s) {
  if (!s.ok()) throw Error{s};
}

std::string errno_message(const std::string& what, int err);

// Anonymous memory for staging and rings, populated now and backed by transparent huge pages where
// the kernel allows: a 1 MiB I/O into 4 KiB pages needs 256 segments, more than some block devices
// take in one request (virtio-blk: 254), and would reach the disk as two 512 KiB requests.
Status map_host(uint64_t bytes, void** ptr);
void unmap_host(void* ptr, uint64_t bytes);

constexpr uint64_t kAlign = 4096;  // O_DIRECT granularity
inline constexpr uint64_t align_up(uint64_t v, uint64_t a = kAlign) { return (v + a - 1) / a * a; }

}  // namespace tutti
