// The gio_uring API's vocabulary (Store::get_iocb, fill_iocb, issue_io, wait_cqe; store.h). The
// IOCBs, queues and agent behind it are the core's own (native/src/gio_queue.h, agent.h).
#pragma once

#include <cstdint>

namespace tutti {

constexpr uint32_t kMaxIoctxPerIocb = 2048;

// A unit without a slot in the pool (a miss): an IOCTX's slot, a request's unit slot, a failure's.
constexpr uint32_t kNoSlot = UINT32_MAX;

// kReadv/kWritev (host producers only): scatter-gather I/O straight between a file and the KV
// blocks; the SQE's `buf_offset` is then the address of an iovec array and `len` its length.
enum class IoOp : uint32_t { kRead = 1, kWrite = 2, kReadv = 4, kWritev = 5 };

}  // namespace tutti
