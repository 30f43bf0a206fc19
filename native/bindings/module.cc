// Python bindings: argument conversion, GIL release and exception mapping only.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <shared_mutex>

#include "tutti/crc32c.h"
#include "tutti/store.h"

namespace py = pybind11;
using namespace tutti;

namespace {

// A leaked reference: a static py::object would be released after the interpreter is gone.
py::handle g_errors;

[[noreturn]] void raise(const Status& s) {
  const char* cls = "TuttiError";
  switch (s.code()) {
    case Code::kNotFound: cls = "NotFound"; break;
    case Code::kCapacityExceeded: cls = "CapacityExceeded"; break;
    case Code::kStorage: cls = "StorageError"; break;
    case Code::kDevice: cls = "DeviceError"; break;
    case Code::kConfig: cls = "ConfigError"; break;
    case Code::kLayout: cls = "LayoutError"; break;
    default: break;
  }
  // Messages may quote bytes from the caller (a layout text): never let decoding them fail.
  PyObject* text = PyUnicode_DecodeUTF8(s.message().data(), static_cast<Py_ssize_t>(s.message().size()), "replace");
  PyErr_SetObject(g_errors.attr(cls).ptr(), text);
  Py_XDECREF(text);
  throw py::error_already_set();
}

void ok(const Status& s) {
  if (!s.ok()) raise(s);
}

// Runs `f` with the GIL released; the status is checked after the GIL is back.
template <typename F>
Status without_gil(F f) {
  py::gil_scoped_release nogil;
  return f();
}

// A Python integer (or anything with __index__) as a 32-bit unsigned value; anything else, or out of
// range, is a TuttiError rather than pybind11's TypeError.
uint32_t u32(const py::handle& v, const char* what) {
  PyObject* i = PyNumber_Index(v.ptr());
  if (!i) {
    PyErr_Clear();
    raise({Code::kInvalid, std::string(what) + " must be an integer"});
  }
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(i, &overflow);
  Py_DECREF(i);
  if (overflow || x < 0 || x > static_cast<long long>(UINT32_MAX))
    raise({Code::kInvalid, std::string(what) + " out of range [0, 2^32)"});
  return static_cast<uint32_t>(x);
}

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using U32Array = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;

// A store held for the length of one call: close() waits until no call holds it.
template <typename T>
struct Held {
  std::shared_lock<std::shared_mutex> lk;
  T* s;
  T& operator*() const { return *s; }
  T* operator->() const { return s; }
};

// The Python objects own their store; close() drops it once the calls in flight (other threads,
// the GIL released) are done, and any later call says the store is closed.
struct PyUnits {
  std::unique_ptr<UnitStore> s;
  std::shared_mutex mu;
  Held<UnitStore> hold() {
    std::shared_lock<std::shared_mutex> lk(mu, std::try_to_lock);
    if (!lk.owns_lock()) {  // close() is running or waiting: wait without the GIL
      py::gil_scoped_release nogil;
      lk.lock();
    }
    if (!s) raise({Code::kInvalid, "store is closed"});
    return {std::move(lk), s.get()};
  }
  void close() {
    py::gil_scoped_release nogil;
    std::unique_lock<std::shared_mutex> lk(mu);
    s.reset();
  }
};
struct PyStore : PyUnits {
  Held<Store> hold() {
    Held<UnitStore> h = PyUnits::hold();
    return {std::move(h.lk), static_cast<Store*>(h.s)};
  }
};

// The bytes of a buffer that must be one contiguous piece of memory (a strided view, such as
// a[::2], is not the bytes its pointer and length would say).
struct Bytes {
  uint8_t* p;
  uint64_t n;
};
// `i` must stay alive while the bytes are used: it holds the export (a bytearray cannot be resized
// meanwhile).
Bytes contiguous(const py::buffer_info& i, const char* what) {
  py::ssize_t want = i.itemsize;
  for (py::ssize_t d = i.ndim; d-- > 0;) {
    if (i.shape[d] > 1 && i.strides[d] != want)
      raise({Code::kLayout, std::string(what) + " must be one contiguous buffer, not a strided view"});
    want *= i.shape[d];
  }
  return {static_cast<uint8_t*>(i.ptr), static_cast<uint64_t>(i.size * i.itemsize)};
}

py::bytes to_bytes(const std::vector<uint8_t>& v) { return py::bytes(reinterpret_cast<const char*>(v.data()), v.size()); }

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Tutti native core: file pool, index, extent map, gio_uring queues and host agent.";
  g_errors = py::module_::import("tutti_cluster.errors").release();
#ifdef TUTTI_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.attr("MAX_IOCTX_PER_IOCB") = kMaxIoctxPerIocb;
  m.attr("FLUSH_COPIERS") = kFlushCopiers;
  m.attr("FLUSH_PARTS") = kFlushParts;

  m.def("crc32c", [](py::buffer b, uint32_t crc) {
    py::buffer_info i = b.request();
    if (!PyBuffer_IsContiguous(i.view(), 'C')) {  // a strided view: sum its bytes in order
      py::bytes copy = py::reinterpret_steal<py::bytes>(PyBytes_FromObject(b.ptr()));
      if (!copy) throw py::error_already_set();
      const std::string v = copy;
      return crc32c_extend(crc, v.data(), v.size());
    }
    return crc32c_extend(crc, i.ptr, static_cast<size_t>(i.size * i.itemsize));
  }, py::arg("data"), py::arg("crc") = 0);

  py::class_<LayerKV>(m, "LayerKVDesc")
      .def(py::init([](std::vector<uint64_t> ptrs, uint64_t block_stride, uint64_t block_bytes, uint64_t num_blocks) {
             if (ptrs.empty() || ptrs.size() > 2) raise({Code::kLayout, "a layer has 1 or 2 object pointers"});
             LayerKV l;
             l.nptr = static_cast<uint32_t>(ptrs.size());
             for (size_t i = 0; i < ptrs.size(); ++i) l.ptr[i] = ptrs[i];
             l.block_stride = block_stride;
             l.block_bytes = block_bytes;
             l.num_blocks = num_blocks;
             return l;
           }),
           py::arg("ptrs"), py::arg("block_stride"), py::arg("block_bytes"), py::arg("num_blocks"));

  py::enum_<ReqOp>(m, "ReqOp").value("RETRIEVE", ReqOp::kRetrieve).value("STORE", ReqOp::kStore);
  py::enum_<IoOp>(m, "IoOp").value("READ", IoOp::kRead).value("WRITE", IoOp::kWrite);

  // The options struct itself: the Python side fills every field from TuttiConfig in one place.
  py::class_<StoreOptions>(m, "StoreOptions")
      .def(py::init<>())
      .def_readwrite("paths", &StoreOptions::paths)
      .def_readwrite("capacity", &StoreOptions::capacity)
      .def_readwrite("memory_paths", &StoreOptions::memory_paths)
      .def_readwrite("memory_capacity", &StoreOptions::memory_capacity)
      // TuttiConfig's words for WritePolicy.
      .def_property(
          "write_policy",
          [](const StoreOptions& o) {
            return std::string(o.write_policy == WritePolicy::kWriteThrough ? "write_through"
                               : o.write_policy == WritePolicy::kMemoryOnly ? "memory_only"
                                                                             : "write_back");
          },
          [](StoreOptions& o, const std::string& v) {
            if (v == "write_back") o.write_policy = WritePolicy::kWriteBack;
            else if (v == "write_through") o.write_policy = WritePolicy::kWriteThrough;
            else if (v == "memory_only") o.write_policy = WritePolicy::kMemoryOnly;
            else throw py::value_error("write_policy must be 'write_back', 'write_through' or 'memory_only', not '" + v + "'");
          })
      .def_readwrite("promote_hits", &StoreOptions::promote_hits)
      .def_readwrite("promote_window_s", &StoreOptions::promote_window_s)
      .def_readwrite("instance", &StoreOptions::instance)
      .def_readwrite("pool_files", &StoreOptions::pool_files)
      .def_readwrite("prewrite_pool", &StoreOptions::prewrite_pool)
      .def_readwrite("unit_blocks", &StoreOptions::unit_blocks)
      .def_readwrite("queue_depth", &StoreOptions::queue_depth)
      .def_readwrite("staging_mb", &StoreOptions::staging_mb)
      .def_readwrite("max_requests", &StoreOptions::max_requests)
      .def_readwrite("io_sms", &StoreOptions::io_sms)
      .def_readwrite("min_io_bytes", &StoreOptions::min_io_bytes)
      // TuttiConfig's words for DirectMode: "auto", "on", "off".
      .def_property(
          "direct_io",
          [](const StoreOptions& o) {
            return std::string(o.direct_io == DirectMode::kOn ? "on" : o.direct_io == DirectMode::kOff ? "off" : "auto");
          },
          [](StoreOptions& o, const std::string& v) {
            if (v == "auto") o.direct_io = DirectMode::kAuto;
            else if (v == "on") o.direct_io = DirectMode::kOn;
            else if (v == "off") o.direct_io = DirectMode::kOff;
            else throw py::value_error("direct_io must be 'auto', 'on' or 'off', not '" + v + "'");
          })
      .def_readwrite("backend", &StoreOptions::backend)
      .def_readwrite("device", &StoreOptions::device)
      .def_readwrite("cuda_pair", &StoreOptions::cuda_pair)
      .def_readwrite("copy_engine_mb", &StoreOptions::copy_engine_mb)
      .def_readwrite("cuda_trace", &StoreOptions::cuda_trace)
      .def_readwrite("read_only", &StoreOptions::read_only)
      .def_readwrite("map_memory_paths", &StoreOptions::map_memory_paths)
      .def_readwrite("file_gid", &StoreOptions::file_gid);

  // Results as the structs themselves (read-only attributes); the Python side turns them into
  // dicts and dataclasses by their attribute names.
  py::class_<Geometry>(m, "Geometry")
      .def_readonly("num_layers", &Geometry::num_layers)
      .def_readonly("objs_per_layer", &Geometry::objs_per_layer)
      .def_readonly("unit_blocks", &Geometry::unit_blocks)
      .def_readonly("block_bytes", &Geometry::block_bytes)
      .def_readonly("obj_bytes", &Geometry::obj_bytes)
      .def_readonly("header_bytes", &Geometry::header_bytes)
      .def_readonly("slot_bytes", &Geometry::slot_bytes)
      .def_readonly("layout_id", &Geometry::layout_id);
  py::class_<StoreStats>(m, "StoreStats")
      .def_readonly("units", &StoreStats::units)
      .def_readonly("pinned", &StoreStats::pinned)
      .def_readonly("free_slots", &StoreStats::free_slots)
      .def_readonly("total_slots", &StoreStats::total_slots)
      .def_readonly("hits", &StoreStats::hits)
      .def_readonly("lookups", &StoreStats::lookups)
      .def_readonly("evictions", &StoreStats::evictions)
      .def_readonly("checksum_failures", &StoreStats::checksum_failures)
      .def_readonly("io_errors", &StoreStats::io_errors)
      .def_readonly("bad_headers", &StoreStats::bad_headers)
      .def_readonly("memory_units", &StoreStats::memory_units)
      .def_readonly("memory_slots", &StoreStats::memory_slots)
      .def_readonly("memory_free_slots", &StoreStats::memory_free_slots)
      .def_readonly("memory_hits", &StoreStats::memory_hits)
      .def_readonly("storage_hits", &StoreStats::storage_hits)
      .def_readonly("memory_bytes_read", &StoreStats::memory_bytes_read)
      .def_readonly("promotions", &StoreStats::promotions)
      .def_readonly("demotions", &StoreStats::demotions)
      .def_readonly("flushes", &StoreStats::flushes)
      .def_readonly("flush_bytes", &StoreStats::flush_bytes)
      .def_readonly("flush_errors", &StoreStats::flush_errors)
      .def_readonly("flush_backlog", &StoreStats::flush_backlog)
      .def_readonly("bytes_read", &StoreStats::bytes_read)
      .def_readonly("bytes_written", &StoreStats::bytes_written)
      .def_readonly("agent_ops", &StoreStats::agent_ops)
      .def_readonly("agent_cpu_s", &StoreStats::agent_cpu_s)
      .def_readonly("kernel_cpu_s", &StoreStats::kernel_cpu_s)
      .def_readonly("direct_ios", &StoreStats::direct_ios)
      .def_readonly("copy_engine_bytes", &StoreStats::copy_engine_bytes)
      .def_readonly("extent_map_bytes", &StoreStats::extent_map_bytes)
      .def_readonly("request_map_peak_bytes", &StoreStats::request_map_peak_bytes)
      .def_readonly("staging_bytes", &StoreStats::staging_bytes)
      .def_readonly("slot_bytes", &StoreStats::slot_bytes)
      .def_readonly("obj_bytes", &StoreStats::obj_bytes)
      .def_readonly("direct_io", &StoreStats::direct_io)
      .def_readonly("fixed_buffers", &StoreStats::fixed_buffers)
      .def_readonly("mapped_files", &StoreStats::mapped_files)
      .def_readonly("backend", &StoreStats::backend);
  py::class_<UnitFailure>(m, "UnitFailure")
      .def_readonly("unit", &UnitFailure::unit)
      .def_readonly("key", &UnitFailure::key)
      .def_property_readonly("cause", [](const UnitFailure& f) { return std::string(unit_fail_cause_name(f.cause)); })
      .def_readonly("error", &UnitFailure::error)
      .def_readonly("pool_file", &UnitFailure::pool_file)
      .def_property_readonly("slot", [](const UnitFailure& f) -> py::object {
        if (f.slot == tutti::kNoSlot) return py::none();
        return py::int_(f.slot);
      })
      .def_readonly("offset", &UnitFailure::offset);
  py::class_<RequestResult>(m, "RequestResult")
      .def_readonly("units", &RequestResult::units)
      .def_readonly("failed_units", &RequestResult::failed_units)
      .def_readonly("failures", &RequestResult::failures)
      .def_readonly("skipped_units", &RequestResult::skipped_units)
      .def_readonly("committed_units", &RequestResult::committed_units)
      .def_readonly("incomplete_layers", &RequestResult::incomplete_layers);

  // The unit store alone (the node daemon's reader): the pools of one instance and geometry, no KV
  // memory, no queues.
  py::class_<PyUnits>(m, "UnitStore")
      .def_static(
          "open",
          [](const StoreOptions& o, uint32_t num_layers, uint32_t objs_per_layer, uint64_t block_bytes, std::string desc) {
            auto* pu = new PyUnits();
            Status st;
            {
              py::gil_scoped_release nogil;
              Geometry g;
              st = make_geometry(num_layers, objs_per_layer, block_bytes, o.unit_blocks, desc, &g);
              if (st.ok()) st = UnitStore::open(o, g, desc, &pu->s);
            }
            if (!st.ok()) {
              delete pu;
              raise(st);
            }
            return pu;
          },
          py::arg("options"), py::arg("num_layers"), py::arg("objs_per_layer"), py::arg("block_bytes"), py::arg("desc"))
      .def("lookup", [](PyUnits& p, U64Array keys) {
        auto held = p.hold();
        UnitStore& s = *held;
        return s.lookup(keys.data(), static_cast<uint32_t>(keys.size()));
      })
      .def("stored_blocks", [](PyUnits& p, U64Array keys) {
        auto held = p.hold();
        UnitStore& s = *held;
        std::vector<uint32_t> out(keys.size());
        s.stored_blocks(keys.data(), static_cast<uint32_t>(keys.size()), out.data());
        return out;
      })
      .def("read_unit", [](PyUnits& p, uint64_t key) {
        auto held = p.hold();
        UnitStore& s = *held;
        std::vector<uint8_t> out;
        {
          ok(without_gil([&] { return s.read_unit(key, &out); }));
        }
        return to_bytes(out);
      })
      .def("read_unit_into", [](PyUnits& p, uint64_t key, py::buffer out, bool verify) {
        auto held = p.hold();
        UnitStore& s = *held;
        py::buffer_info i = out.request(true);
        const Bytes d = contiguous(i, "out");
        ok(without_gil([&] { return s.read_unit_into(key, d.p, d.n, verify); }));
        return s.geometry().slot_bytes;
      }, py::arg("key"), py::arg("out"), py::arg("verify") = true)
      .def("refresh", [](PyUnits& p) {
        auto held = p.hold();
        UnitStore& s = *held;
        ok(without_gil([&] { return s.refresh(); }));
      })
      .def("import_unit", [](PyUnits& p, py::buffer data) {
        auto held = p.hold();
        UnitStore& s = *held;
        py::buffer_info i = data.request();
        const Bytes d = contiguous(i, "data");
        uint64_t key;
        ok(without_gil([&] { return s.import_unit(d.p, d.n, &key); }));
        return key;
      })
      .def("pin", [](PyUnits& p, U64Array keys, bool on) { p.hold()->pin(keys.data(), static_cast<uint32_t>(keys.size()), on); })
      .def("promote", [](PyUnits& p, U64Array keys) {
        return p.hold()->promote(keys.data(), static_cast<uint32_t>(keys.size()));
      })
      .def("remove", [](PyUnits& p, uint64_t key) {
        bool removed = false;
        ok(p.hold()->remove(key, &removed));
        return removed;
      })
      .def("keys", [](PyUnits& p) { return p.hold()->keys(); })
      .def("unit_tiers", [](PyUnits& p, U64Array keys) {
        std::vector<uint8_t> out(keys.size());
        p.hold()->unit_tiers(keys.data(), static_cast<uint32_t>(keys.size()), out.data());
        return out;
      })
      .def("flush", [](PyUnits& p, double timeout_s) {
        auto held = p.hold();
        UnitStore& s = *held;
        py::gil_scoped_release nogil;
        return s.flush(timeout_s);
      }, py::arg("timeout_s") = -1.0)
      .def("inner_keys", [](PyUnits& p) {
        std::vector<uint64_t> v = p.hold()->inner_keys();
        py::array_t<uint64_t> out(static_cast<py::ssize_t>(v.size()));
        std::copy(v.begin(), v.end(), out.mutable_data());
        return out;
      })
      .def("drain_evicted", [](PyUnits& p) { return p.hold()->drain_evicted(); })
      .def("geometry", [](PyUnits& p) { return p.hold()->geometry(); })
      .def("stats", [](PyUnits& p) { return p.hold()->stats(); })
      .def("close", [](PyUnits& p) { p.close(); });
;

  // An engine session: a unit store plus the engine API over the registered KV memory.
  py::class_<PyStore, PyUnits>(m, "Store")
      .def_static(
          "open",
          [](const StoreOptions& o, std::vector<LayerKV> layers, std::string desc) {
            auto* ps = new PyStore();
            Status st;
            {
              py::gil_scoped_release nogil;
              std::unique_ptr<Store> opened;
              st = Store::open(o, layers, desc, &opened);
              ps->s = std::move(opened);
            }
            if (!st.ok()) {
              delete ps;
              raise(st);
            }
            return ps;
          },
          py::arg("options"), py::arg("layers"), py::arg("desc"))
      .def("init_queue", [](PyStore& p, uint32_t depth) {
        auto held = p.hold();
        Store& s = *held;
        ok(without_gil([&] { return s.init_queue(depth); }));
      })
      .def("begin", [](PyStore& p, ReqOp op, U64Array keys, I64Array blocks, std::optional<U64Array> inner,
                       std::optional<U32Array> counts) {
        auto held = p.hold();
        Store& s = *held;
        if (inner.has_value() != counts.has_value())
          raise({Code::kLayout, "begin: give inner keys and their counts per unit together"});
        if (counts) {
          uint64_t total = 0;
          for (py::ssize_t i = 0; i < counts->size(); ++i) total += counts->data()[i];
          if (static_cast<uint64_t>(counts->size()) != keys.size() || total != static_cast<uint64_t>(inner->size()))
            raise({Code::kLayout, "begin: " + std::to_string(counts->size()) + " inner key counts for " +
                                      std::to_string(keys.size()) + " units, summing to " + std::to_string(total) +
                                      " of " + std::to_string(inner->size()) + " inner keys"});
        }
        uint32_t id;
        ok(without_gil([&] { return s.begin(op, keys.data(), static_cast<uint32_t>(keys.size()), blocks.data(),
                   static_cast<uint64_t>(blocks.size()), &id, inner ? inner->data() : nullptr,
                   counts ? counts->data() : nullptr); }));
        return id;
      }, py::arg("op"), py::arg("keys"), py::arg("blocks"), py::arg("inner") = py::none(), py::arg("inner_counts") = py::none())
      .def("layer", [](PyStore& p, py::handle layer, py::handle req, uint64_t event, int64_t stream) {
        auto held = p.hold();
        Store& s = *held;
        const uint32_t l = u32(layer, "layer"), r = u32(req, "request");
        ok(without_gil([&] { return s.layer(l, r, event, stream); }));
      }, py::arg("layer"), py::arg("request"), py::arg("event") = 0, py::arg("stream") = -1)
      .def("wait_layer", [](PyStore& p, py::handle layer, py::handle req, uint64_t stream) {
        auto held = p.hold();
        Store& s = *held;
        const uint32_t l = u32(layer, "layer"), r = u32(req, "request");
        ok(without_gil([&] { return s.wait_layer(l, r, stream); }));
      }, py::arg("layer"), py::arg("request"), py::arg("stream") = 0)
      .def("finish", [](PyStore& p, py::handle req) {
        auto held = p.hold();
        Store& s = *held;
        const uint32_t id = u32(req, "request");
        RequestResult r;
        ok(without_gil([&] { return s.finish(id, &r); }));
        return r;
      })
      .def("done", [](PyStore& p, py::handle req) {
        bool out = false;
        ok(p.hold()->done(u32(req, "request"), &out));
        return out;
      })
      .def("get_iocb", [](PyStore& p, py::handle n) {
        std::vector<uint32_t> ids;
        ok(p.hold()->get_iocb(u32(n, "n"), &ids));
        return ids;
      })
      .def("fill_iocb", [](PyStore& p, py::handle id, IoOp op, py::handle layer, py::handle request, py::handle first,
                           py::handle count) {
        ok(p.hold()->fill_iocb(u32(id, "iocb"), op, u32(layer, "layer"), u32(request, "request"), u32(first, "first"),
                             u32(count, "count")));
      })
      .def("issue_io", [](PyStore& p, py::iterable ids, py::handle sms, uint64_t event) {
        auto held = p.hold();
        Store& s = *held;
        std::vector<uint32_t> v;
        for (py::handle h : ids) v.push_back(u32(h, "iocb"));
        const uint32_t n_sms = u32(sms, "sms");
        ok(without_gil([&] { return s.issue_io(v.data(), static_cast<uint32_t>(v.size()), n_sms, event); }));
      }, py::arg("ids"), py::arg("sms") = 0, py::arg("event") = 0)
      .def("wait_cqe", [](PyStore& p, py::handle id) {
        auto held = p.hold();
        Store& s = *held;
        const uint32_t b = u32(id, "iocb");
        uint64_t errors = 0;
        ok(without_gil([&] { return s.wait_cqe(b, &errors); }));
        return errors;
      })
      .def("put_iocb", [](PyStore& p, py::handle id) { ok(p.hold()->put_iocb(u32(id, "iocb"))); })
      .def("compute_stream", [](PyStore& p) { return p.hold()->compute_stream(); })
      .def("scatter_unit", [](PyStore& p, py::buffer data, I64Array blocks) {
        auto held = p.hold();
        Store& s = *held;
        py::buffer_info i = data.request();
        const Bytes d = contiguous(i, "data");
        ok(without_gil([&] { return s.scatter_unit(d.p, d.n, blocks.data(), static_cast<uint64_t>(blocks.size())); }));
      })
      .def("scatter_unit_async", [](PyStore& p, py::buffer data, I64Array blocks, int64_t stream, py::object key) {
        auto held = p.hold();
        Store& s = *held;
        py::buffer_info i = data.request();
        const Bytes d = contiguous(i, "data");
        const bool check = !key.is_none();
        const uint64_t want = check ? key.cast<uint64_t>() : 0;
        uint64_t ticket = 0;
        ok(without_gil([&] {
          return s.scatter_unit_async(d.p, d.n, blocks.data(), static_cast<uint64_t>(blocks.size()), stream, &ticket,
                                      check ? &want : nullptr);
        }));
        return ticket;
      }, py::arg("data"), py::arg("blocks"), py::arg("stream"), py::arg("key") = py::none())
      .def("scatter_wait", [](PyStore& p, uint64_t ticket) {
        auto held = p.hold();
        Store& s = *held;
        ok(without_gil([&] { return s.scatter_wait(ticket); }));
      })
      .def("register_host", [](PyStore& p, py::buffer data) {
        auto held = p.hold();
        Store& s = *held;
        py::buffer_info i = data.request();
        const Bytes d = contiguous(i, "data");
        ok(s.register_host(d.p, d.n));
        return reinterpret_cast<uint64_t>(d.p);
      })
      .def("unregister_host", [](PyStore& p, uint64_t addr) { p.hold()->unregister_host(reinterpret_cast<void*>(addr)); });
}
