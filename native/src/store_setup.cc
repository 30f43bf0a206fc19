// The engine session's lifetime (store.h): opening, the queues and IOCB table (init_queue), host
// memory registration, stats and closing.
#include "tutti/store.h"

#include <algorithm>
#include <cstring>

#include "agent.h"
#include "backend.h"
#include "extent.h"
#include "gio_queue.h"
#include "pool.h"

namespace tutti {

Status Store::open(const StoreOptions& opt, const std::vector<LayerKV>& layers, const std::string& desc,
                   std::unique_ptr<Store>* out) {
  if (opt.read_only) return {Code::kInvalid, "an engine session writes: open a UnitStore to read pools only"};
  std::unique_ptr<Store> s(new Store());
  Geometry g;
  Status st = make_geometry(layers, opt.unit_blocks, desc, &g);
  if (!st.ok()) return st;
  st = s->extents_->init(layers);
  if (!st.ok()) return st;
  st = s->open_units(opt, g, desc);
  if (!st.ok()) return st;
  *out = std::move(s);
  return Status::Ok();
}

Store::Store()
    : extents_(std::make_unique<ExtentMap>()),
      agent_(std::make_unique<Agent>()),
      kernel_bell_(std::make_unique<Doorbell>()),
      done_bell_(std::make_unique<Doorbell>()),
      kctx_(std::make_unique<KernelContext>()) {}

Status Store::init_queue(uint32_t depth) {
  if (started_) return {Code::kInvalid, "queues already initialised"};
  if (depth == 0) return {Code::kConfig, "queue depth must be positive"};
  const Geometry& g = geom_;
  if (opt_.backend == "cpu") {
    backend_ = make_host_backend();
  } else if (opt_.backend == "cuda") {
#ifdef TUTTI_WITH_CUDA
    if (opt_.copy_engine_mb > (UINT64_MAX >> 20))
      return {Code::kConfig, "copy_engine_mb (" + std::to_string(opt_.copy_engine_mb) + ") does not fit 64 bits of bytes"};
    Status st;
    backend_ = make_cuda_backend(opt_.device, opt_.cuda_pair, opt_.cuda_trace, opt_.copy_engine_mb << 20, &st);
    if (!st.ok()) return st;
#else
    return {Code::kDevice, "backend 'cuda' requested but this build has no CUDA support"};
#endif
  } else {
    return {Code::kConfig, "unknown backend '" + opt_.backend + "'"};
  }
  const uint64_t chunk = std::max(g.obj_bytes, g.header_bytes);
  if (opt_.staging_mb > (UINT64_MAX >> 20))
    return {Code::kConfig, "staging_mb (" + std::to_string(opt_.staging_mb) + ") does not fit 64 bits of bytes"};
  const uint64_t staging_request = opt_.staging_mb << 20;
  uint32_t chunks = static_cast<uint32_t>(std::min<uint64_t>(staging_request / chunk, UINT32_MAX));
  if (chunks < 2)
    return {Code::kConfig, "staging_mb (" + std::to_string(opt_.staging_mb) + ") must hold at least two objects of " +
                               std::to_string(chunk) + " bytes"};
  const uint32_t workers = std::max<uint32_t>(1, backend_->num_workers(std::max<uint32_t>(1, opt_.io_workers), opt_.io_sms));
  const uint32_t nq = backend_->num_queues(workers);
  if (chunks < nq)
    return {Code::kConfig, "staging_mb (" + std::to_string(opt_.staging_mb) + ") must hold at least " +
                               std::to_string(nq) + " objects of " + std::to_string(chunk) + " bytes (one per I/O queue)"};
  chunks -= chunks % nq;
  staging_bytes_ = static_cast<uint64_t>(chunks) * chunk;
  Status st = backend_->alloc_host(staging_bytes_, &staging_);
  if (!st.ok()) return st;
  // One SQ/CQ pair per queue, each deep enough for all of that queue's chunks.
  const uint64_t ring_depth = chunks / nq + 1;
  const uint64_t per_q = 2 * sizeof(RingCtl) + ring_depth * (sizeof(Sqe) + sizeof(Cqe));
  queue_bytes_ = align_up(per_q * nq);
  st = backend_->alloc_host(queue_bytes_, &queue_mem_);
  if (!st.ok()) return st;
  std::memset(queue_mem_, 0, queue_bytes_);
  std::vector<QueuePair> qs;
  uint8_t* p = static_cast<uint8_t*>(queue_mem_);
  for (uint32_t w = 0; w < nq; ++w) {
    QueuePair q;
    q.depth = ring_depth;
    q.sq_ctl = reinterpret_cast<RingCtl*>(p);
    q.cq_ctl = reinterpret_cast<RingCtl*>(p + sizeof(RingCtl));
    q.sq = reinterpret_cast<Sqe*>(p + 2 * sizeof(RingCtl));
    q.cq = reinterpret_cast<Cqe*>(p + 2 * sizeof(RingCtl) + ring_depth * sizeof(Sqe));
    qs.push_back(q);
    p += per_q;
  }
  iocb_bytes_ = align_up(static_cast<uint64_t>(depth) * sizeof(Iocb));
  void* iocb_mem = nullptr;
  st = backend_->alloc_host(iocb_bytes_, &iocb_mem);
  if (!st.ok()) return st;
  std::memset(iocb_mem, 0, iocb_bytes_);
  iocbs_ = static_cast<Iocb*>(iocb_mem);
  num_iocbs_ = depth;
  for (uint32_t i = depth; i-- > 0;) free_iocbs_.push_back(i);
  iocb_owner_.assign(depth, kFree);
  raw_issue_.assign(depth, RawIssue{});
  requests_.assign(opt_.max_requests, Request{});
  views_.assign(opt_.max_requests, RequestView{});

  Agent::Options ao;
  ao.depth = opt_.queue_depth;
  for (uint32_t i = 0; i < pool_->num_paths(); ++i) {
    ao.fds.push_back(pool_->path(i).fd);
    // Memory-backed file systems complete every request inline, O_DIRECT or not (tmpfs accepts
    // O_DIRECT since Linux 6.6): punt those to io_uring's workers so that copies run in parallel.
    ao.punt.push_back(pool_->path(i).cached() ? 1 : 0);
  }
  ao.staging = staging_;
  ao.staging_bytes = staging_bytes_;
  ao.poll_rings = backend_->host_agent_polls();
  st = agent_->start(ao, qs, kernel_bell_.get());
  if (!st.ok()) return st;

  kctx_->geom = g;
  kctx_->extents = extents_.get();
  kctx_->iocbs = iocbs_;
  kctx_->num_iocbs = depth;
  kctx_->requests = views_.data();
  kctx_->max_requests = opt_.max_requests;
  kctx_->staging = static_cast<uint8_t*>(staging_);
  kctx_->chunk_bytes = chunk;
  kctx_->num_chunks = chunks;
  kctx_->queues = qs;
  kctx_->queue_depth = opt_.queue_depth;
  if (opt_.map_memory_paths) {
    st = pool_->map_memory_files();
    if (!st.ok()) return st;
  }
  kctx_->buffer_align.clear();
  kctx_->mapped.clear();
  kctx_->mapped_bytes.clear();
  for (uint32_t i = 0; i < pool_->num_paths(); ++i) {
    kctx_->buffer_align.push_back(pool_->path(i).buffer_align);
    kctx_->mapped.push_back(pool_->path(i).map);
    kctx_->mapped_bytes.push_back(pool_->path(i).map_bytes);
  }
  kctx_->agent = agent_.get();
  kctx_->kernel_bell = kernel_bell_.get();
  kctx_->done_bell = done_bell_.get();
  st = backend_->start(kctx_.get(), workers);
  if (!st.ok()) return st;
  started_ = true;
  return Status::Ok();
}

Store::~Store() { close(); }

void Store::close() {
  if (started_) {
    for (uint32_t i = 0; i < requests_.size(); ++i)
      if (requests_[i].active) {
        RequestResult r;
        finish(i, &r);
      }
    for (uint64_t t : scatter_ticket_)  // scatters not waited for: their blocks are the caller's loss
      if (t) scatter_wait(t);
    backend_->stop();
    agent_->stop();
    backend_->free_host(staging_, staging_bytes_);
    backend_->free_host(queue_mem_, queue_bytes_);
    backend_->free_host(iocbs_, iocb_bytes_);
    iocbs_ = nullptr;
    num_iocbs_ = 0;
    started_ = false;
  }
  UnitStore::close();
}

Status Store::register_host(void* p, uint64_t n) {
  if (!started_) return {Code::kInvalid, "store is closed or read-only"};
  if (!p || n == 0) return {Code::kInvalid, "register_host needs a non-empty buffer"};
  return backend_->register_host(p, n);
}

void Store::unregister_host(void* p) {
  if (started_) backend_->unregister_host(p);
}

uint64_t Store::compute_stream() const { return backend_ ? backend_->compute_stream() : 0; }

StoreStats Store::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  StoreStats s = units_stats();
  s.agent_ops = agent_->ops();
  s.agent_cpu_s = agent_->cpu_seconds();
  s.kernel_cpu_s = backend_ ? backend_->kernel_cpu_seconds() : 0;
  s.direct_ios = backend_ ? backend_->direct_ios() : 0;
  s.copy_engine_bytes = backend_ ? backend_->copy_engine_bytes() : 0;
  s.extent_map_bytes = extents_->memory_bytes() + request_map_peak_;
  s.request_map_peak_bytes = request_map_peak_;
  s.staging_bytes = staging_bytes_;
  s.fixed_buffers = agent_->fixed_buffers();
  for (const uint8_t* m : kctx_->mapped) s.mapped_files += m ? 1 : 0;
  s.backend = backend_ ? backend_->name() : "none";
  return s;
}

}  // namespace tutti
