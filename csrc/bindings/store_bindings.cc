// Bindings of the store: StoreClient, StorageNode, MasterServer, EmbeddedCluster, their
// options, and QueryClusterStatus.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "kvbridge/store.h"

namespace kvbridge::bindings {
namespace {

StorageNode& NodeAt(EmbeddedCluster& c, size_t i) {
  auto& nodes = c.nodes();
  if (i >= nodes.size()) {
    throw StatusError(Status::InvalidArgument("node index " + std::to_string(i) +
                                              " out of range (cluster has " +
                                              std::to_string(nodes.size()) + " nodes)"));
  }
  if (!nodes[i])
    throw StatusError(Status::Unavailable("node " + std::to_string(i) + " is stopped"));
  return *nodes[i];
}

// The embedded cluster, plus a lock for its node slots: calls on a node hold it shared and
// stop_node exclusively while it takes the node out of its slot, so a node is never destroyed
// under a call still using it (a stop waits for them, a drain in flight included; later calls
// fail with "node i is stopped").
class ClusterHandle : public Handle<EmbeddedCluster> {
 public:
  using Handle::Handle;

  template <typename F>
  decltype(auto) WithNode(size_t i, F&& f) {
    return With([&](EmbeddedCluster& c) -> decltype(auto) {
      std::shared_lock lock(nodes_mu_);
      return f(NodeAt(c, i));
    });
  }
  // Takes node i out of the cluster; the caller destroys it (no lock held).
  std::unique_ptr<StorageNode> TakeNode(size_t i) {
    return With([&](EmbeddedCluster& c) {
      std::unique_lock lock(nodes_mu_);
      NodeAt(c, i);  // range and state check
      return std::move(c.nodes()[i]);
    });
  }

 private:
  std::shared_mutex nodes_mu_;
};

using NodeHandle = Handle<StorageNode>;
using MasterHandle = Handle<MasterServer>;
// One key's buffers: (address, length) pairs.
using PyBuffers = std::vector<std::pair<uintptr_t, uint64_t>>;

// A StoreClient of its own, or the client an EmbeddedCluster owns (then it lives, and is
// closed, with the cluster).
class PyStoreClient {
 public:
  explicit PyStoreClient(std::unique_ptr<StoreClient> c)
      : owned_(std::make_shared<Handle<StoreClient>>(std::move(c), "StoreClient")) {}
  explicit PyStoreClient(std::shared_ptr<ClusterHandle> cluster) : cluster_(std::move(cluster)) {}

  template <typename F>
  decltype(auto) With(F&& f) {
    if (owned_) return owned_->With(f);
    return cluster_->With([&](EmbeddedCluster& c) -> decltype(auto) { return f(c.client()); });
  }
  void Close() {
    if (owned_) owned_->Close();  // a cluster's client closes with its cluster
  }

 private:
  std::shared_ptr<Handle<StoreClient>> owned_;
  std::shared_ptr<ClusterHandle> cluster_;
};

std::vector<std::vector<BufferRef>> ToBuffers(const std::vector<PyBuffers>& in) {
  std::vector<std::vector<BufferRef>> out;
  out.reserve(in.size());
  for (const auto& key_bufs : in) {
    auto& v = out.emplace_back();
    v.reserve(key_bufs.size());
    for (const auto& [addr, len] : key_bufs) v.push_back({reinterpret_cast<void*>(addr), len});
  }
  return out;
}

void CheckSameLength(size_t keys, size_t buffers) {
  if (keys != buffers) {
    throw StatusError(Status::InvalidArgument(std::to_string(keys) + " keys but " +
                                              std::to_string(buffers) + " buffer lists"));
  }
}

// The pointer-list form of a batch (Mooncake's batch_put_from / batch_get_into arguments, and
// their *_multi_buffers forms): registered buffers given as parallel lists of keys,
// addresses and lengths. Read without building a Python object per key; at 128 keys per call
// the general conversion cost about 0.4 ms of a 3 ms store get (0.7 ms with two buffers per
// key).
struct PtrBatch {
  std::vector<std::string> keys;
  std::vector<std::vector<BufferRef>> buffers;
};

// One key's buffers: an address and a length (multi false), or lists of them of one length
// (multi true); false if anything else.
bool ReadBuffers(PyObject* addr, PyObject* len, bool multi, std::vector<BufferRef>* out) {
  if (!multi) {
    const auto a = PositiveInt(addr), n = PositiveInt(len);
    if (!a || !n) return false;
    out->push_back({reinterpret_cast<void*>(*a), *n});
    return true;
  }
  if (!PyList_CheckExact(addr) || !PyList_CheckExact(len)) return false;
  const Py_ssize_t count = PyList_GET_SIZE(addr);
  if (count == 0 || PyList_GET_SIZE(len) != count) return false;
  out->reserve(count);
  for (Py_ssize_t j = 0; j < count; ++j) {
    if (!ReadBuffers(PyList_GET_ITEM(addr, j), PyList_GET_ITEM(len, j), false, out)) return false;
  }
  return true;
}

// False unless keys, addresses and lengths are lists of one length, every key a str or bytes
// (distinct, when unique_keys), every address and length a positive int (multi: a non-empty
// list of them, one length per address). Anything else goes to the general path, which names
// what is wrong.
//
// The batch is read into `b`, whose strings and vectors keep their capacity from the call
// before: a thread's steady stream of batches allocates nothing here (two allocations per key
// and their frees were about 6% of a 16 KiB embedded get).
bool ReadPtrBatch(const py::handle& keys, const py::handle& addrs, const py::handle& lens,
                  bool multi, bool unique_keys, PtrBatch& b) {
  if (!PyList_CheckExact(keys.ptr()) || !PyList_CheckExact(addrs.ptr()) ||
      !PyList_CheckExact(lens.ptr())) {
    return false;
  }
  const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
  if (PyList_GET_SIZE(addrs.ptr()) != n || PyList_GET_SIZE(lens.ptr()) != n) return false;
  b.keys.resize(n);
  b.buffers.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* k = PyList_GET_ITEM(keys.ptr(), i);
    const char* data = nullptr;
    Py_ssize_t size = 0;
    if (PyUnicode_CheckExact(k)) {
      data = PyUnicode_AsUTF8AndSize(k, &size);
      if (data == nullptr) {
        PyErr_Clear();  // not encodable (lone surrogates)
        return false;
      }
    } else if (PyBytes_CheckExact(k)) {
      data = PyBytes_AS_STRING(k);
      size = PyBytes_GET_SIZE(k);
    } else {
      return false;
    }
    b.buffers[i].clear();
    if (!ReadBuffers(PyList_GET_ITEM(addrs.ptr(), i), PyList_GET_ITEM(lens.ptr(), i), multi,
                     &b.buffers[i])) {
      return false;
    }
    b.keys[i].assign(data, static_cast<size_t>(size));
  }
  if (unique_keys) {
    // Sorted views, not a hash set: one allocation per batch instead of one per key.
    std::vector<std::string_view> sorted(b.keys.begin(), b.keys.end());
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) return false;
  }
  return true;
}

// The calling thread's PtrBatch, reused from batch to batch (ReadPtrBatch); one larger than
// kKeptKeys is let go after its call rather than held for the thread's life.
struct ScratchBatch {
  static constexpr size_t kKeptKeys = 4096;
  PtrBatch& batch;
  ScratchBatch() : batch(Get()) {}
  ~ScratchBatch() {
    if (batch.keys.size() > kKeptKeys) batch = PtrBatch{};
  }
  ScratchBatch(const ScratchBatch&) = delete;
  ScratchBatch& operator=(const ScratchBatch&) = delete;

 private:
  static PtrBatch& Get() {
    thread_local PtrBatch b;
    return b;
  }
};

// Failed keys only: {index: Status}.
py::dict Failures(const std::vector<Status>& st) {
  py::dict out;
  for (size_t i = 0; i < st.size(); ++i) {
    if (!st[i].ok()) out[py::int_(i)] = py::cast(bindings::ToPy(st[i]));
  }
  return out;
}

std::vector<PyStatus> ToPy(const std::vector<Status>& v) {
  std::vector<PyStatus> out;
  out.reserve(v.size());
  for (const auto& s : v) out.push_back(bindings::ToPy(s));
  return out;
}

// Per-key sizes: (status, size) pairs, size 0 where the status is not OK.
std::vector<std::pair<PyStatus, uint64_t>> ToPy(const std::vector<Result<uint64_t>>& rs) {
  std::vector<std::pair<PyStatus, uint64_t>> out;
  out.reserve(rs.size());
  for (const auto& r : rs) {
    out.emplace_back(r.ok() ? PyStatus{} : bindings::ToPy(r.status()), r.ok() ? r.value() : 0);
  }
  return out;
}

py::dict ToPy(const ClusterStatus& cs) {
  py::list nodes;
  for (const auto& n : cs.nodes) {
    py::dict d;
    d["node_id"] = n.id.node_id;
    d["incarnation"] = n.id.incarnation;
    d["state"] = n.state;
    d["capacity_bytes"] = n.capacity_bytes;
    d["used_bytes"] = n.used_bytes;
    d["replicas"] = n.replicas;
    d["ssd_capacity_bytes"] = n.ssd_capacity_bytes;
    d["ssd_used_bytes"] = n.ssd_used_bytes;
    nodes.append(std::move(d));
  }
  py::dict d;
  d["nodes"] = nodes;
  d["objects"] = cs.objects;
  d["pending_puts"] = cs.pending_puts;
  d["stored_bytes"] = cs.stored_bytes;
  d["evictions_total"] = cs.evictions_total;
  d["bad_replicas_total"] = cs.bad_replicas_total;
  d["unreachable_reports_total"] = cs.unreachable_reports_total;
  d["nodes_expired_total"] = cs.nodes_expired_total;
  d["under_replicated"] = cs.under_replicated;
  d["demotions_total"] = cs.demotions_total;
  d["ssd_replicas"] = cs.ssd_replicas;
  d["promotions_total"] = cs.promotions_total;
  d["departed_copies"] = cs.departed_copies;
  return d;
}

// StoreClient.stats(): the counters as plain values (docs/python.md "Client statistics and
// metrics" lists the keys); kvbridge.store adds what is derived from them (hit_rate).
py::dict ToPy(const StoreClientStats& s) {
  py::dict ops;
  for (size_t i = 0; i < kStoreOpCount; ++i) {
    const StoreOpStats& o = s.ops[i];
    py::dict errors;
    for (const auto& [code, n] : o.errors) errors[py::str(StatusCodeName(code))] = n;
    // Cumulative (upper bound, calls), as Prometheus histograms count them.
    py::list buckets;
    uint64_t below = 0;
    for (size_t b = 0; b < o.latency_buckets.size(); ++b) {
      below += o.latency_buckets[b];
      const double le = b < StoreOpStats::kLatencyBounds.size()
                            ? StoreOpStats::kLatencyBounds[b]
                            : std::numeric_limits<double>::infinity();
      buckets.append(py::make_tuple(le, below));
    }
    py::dict d;
    d["calls"] = o.calls;
    d["keys"] = o.keys;
    d["errors"] = errors;
    d["seconds_sum"] = static_cast<double>(o.latency_ns) / 1e9;
    d["seconds_buckets"] = buckets;
    ops[StoreOpName(static_cast<StoreOp>(i))] = d;
  }
  py::dict d;
  d["get_hits"] = s.get_hits();
  d["get_hits_dram"] = s.get_hits_dram;
  d["get_hits_ssd"] = s.get_hits_ssd;
  d["get_misses"] = s.get_misses;
  d["bytes_read"] = s.bytes_read;
  d["puts_stored"] = s.puts_stored;
  d["puts_existing"] = s.puts_existing;
  d["bytes_written"] = s.bytes_written;
  d["removes"] = s.removes;
  d["gets_without_master"] = s.gets_without_master;
  d["ops"] = ops;
  return d;
}

void BindOptions(py::module_& m) {
  py::class_<StoreOptions>(m, "StoreOptions")
      .def(py::init<>())
      .def_static("from_env", &StoreOptions::FromEnv)
      .def_readwrite("master", &StoreOptions::master_address)
      .def_readwrite("replica_num", &StoreOptions::replica_num)
      .def_readwrite("rpc_timeout_ms", &StoreOptions::rpc_timeout_ms)
      .def_readwrite("store_transfer_deadline_ms", &StoreOptions::transfer_deadline_ms)
      .def_readwrite("verify_checksums", &StoreOptions::verify_checksums)
      .def_readwrite("hedge_after_ms", &StoreOptions::hedge_after_ms)
      .def_readwrite("hedge_bandwidth_mbps", &StoreOptions::hedge_bandwidth_mbps)
      .def_readwrite("location_cache_entries", &StoreOptions::location_cache_entries)
      .def_readwrite("master_wait_ms", &StoreOptions::master_wait_ms)
      .def_readwrite("hard_pin", &StoreOptions::hard_pin)
      .def_readwrite("soft_pin", &StoreOptions::soft_pin)
      .def_readwrite("soft_pin_ttl_ms", &StoreOptions::soft_pin_ttl_ms)
      .def_readwrite("peer_discovery", &StoreOptions::peer_discovery)
      .def_readwrite("admin_token", &StoreOptions::admin_token)
      .def_readwrite("client_faults", &StoreOptions::faults)
      .def_readwrite("engine", &StoreOptions::engine);
  py::class_<NodeOptions>(m, "NodeOptions")
      .def(py::init<>())
      .def_static("from_env", &NodeOptions::FromEnv)
      .def_readwrite("master", &NodeOptions::master_address)
      .def_readwrite("node_dram_bytes", &NodeOptions::dram_bytes)
      .def_readwrite("node_storage_plugin", &NodeOptions::storage_plugin)
      .def_readwrite("node_rpc_listen", &NodeOptions::rpc_listen)
      .def_readwrite("rpc_timeout_ms", &NodeOptions::rpc_timeout_ms)
      .def_readwrite("drain_timeout_ms", &NodeOptions::drain_timeout_ms)
      .def_readwrite("node_ssd_path", &NodeOptions::ssd_path)
      .def_readwrite("node_ssd_bytes", &NodeOptions::ssd_bytes)
      .def_readwrite("node_ssd_plugin", &NodeOptions::ssd_plugin)
      .def_readwrite("node_ssd_staging_bytes", &NodeOptions::ssd_staging_bytes)
      .def_readwrite("peer_discovery", &NodeOptions::peer_discovery)
      .def_readwrite("rpc_auth_skew_ms", &NodeOptions::rpc_auth_skew_ms)
      .def_readwrite("metrics_listen", &NodeOptions::metrics_listen)
      .def_readwrite("metrics_listen_best_effort", &NodeOptions::metrics_listen_best_effort)
      .def_readwrite("metrics_token", &NodeOptions::metrics_token)
      .def_readwrite("node_faults", &NodeOptions::faults)
      .def_readwrite("engine", &NodeOptions::engine);
  py::class_<MasterOptions>(m, "MasterOptions")
      .def(py::init<>())
      .def_static("from_env", &MasterOptions::FromEnv)
      .def_readwrite("master_listen", &MasterOptions::listen)
      .def_readwrite("node_ttl_ms", &MasterOptions::node_ttl_ms)
      .def_readwrite("lease_ms", &MasterOptions::lease_ms)
      .def_readwrite("put_timeout_ms", &MasterOptions::put_timeout_ms)
      .def_readwrite("soft_pin_ttl_ms", &MasterOptions::soft_pin_ttl_ms)
      .def_readwrite("min_replicas", &MasterOptions::min_replicas)
      .def_readwrite("high_watermark", &MasterOptions::high_watermark)
      .def_readwrite("low_watermark", &MasterOptions::low_watermark)
      .def_readwrite("demote_high_watermark", &MasterOptions::demote_high_watermark)
      .def_readwrite("demote_low_watermark", &MasterOptions::demote_low_watermark)
      .def_readwrite("promote_after_reads", &MasterOptions::promote_after_reads)
      .def_readwrite("drain_timeout_ms", &MasterOptions::drain_timeout_ms)
      .def_readwrite("rpc_timeout_ms", &MasterOptions::rpc_timeout_ms)
      .def_readwrite("task_timeout_ms", &MasterOptions::task_timeout_ms)
      .def_readwrite("departed_node_ttl_ms", &MasterOptions::departed_node_ttl_ms)
      .def_readwrite("max_departed_nodes", &MasterOptions::max_departed_nodes)
      .def_readwrite("max_departed_copies", &MasterOptions::max_departed_copies)
      .def_readwrite("master_faults", &MasterOptions::faults)
      .def_readwrite("cluster_token", &MasterOptions::cluster_token)
      .def_readwrite("admin_token", &MasterOptions::admin_token)
      .def_readwrite("rpc_auth_skew_ms", &MasterOptions::rpc_auth_skew_ms)
      .def_readwrite("metrics_listen", &MasterOptions::metrics_listen)
      .def_readwrite("metrics_listen_best_effort", &MasterOptions::metrics_listen_best_effort)
      .def_readwrite("master_etcd", &MasterOptions::etcd)
      .def_readwrite("master_advertise", &MasterOptions::advertise)
      .def_readwrite("ha_lease_ms", &MasterOptions::ha_lease_ms)
      .def_readwrite("ha_takeover_wait_ms", &MasterOptions::ha_takeover_wait_ms)
      .def_readwrite("master_fast_port", &MasterOptions::fast_port)
      .def_readwrite("metrics_token", &MasterOptions::metrics_token);
  py::class_<EmbeddedClusterOptions>(m, "ClusterOptions")
      .def(py::init<>())
      .def_readwrite("nodes", &EmbeddedClusterOptions::nodes)
      .def_readwrite("dram_bytes_per_node", &EmbeddedClusterOptions::dram_bytes_per_node)
      .def_readwrite("replica_num", &EmbeddedClusterOptions::replica_num)
      .def_readwrite("node_id_prefix", &EmbeddedClusterOptions::node_id_prefix)
      .def_readwrite("ssd_dir", &EmbeddedClusterOptions::ssd_dir)
      .def_readwrite("peer_discovery", &EmbeddedClusterOptions::peer_discovery)
      .def_readwrite("ssd_bytes_per_node", &EmbeddedClusterOptions::ssd_bytes_per_node)
      .def_readwrite("ssd_plugin", &EmbeddedClusterOptions::ssd_plugin)
      .def_readwrite("master", &EmbeddedClusterOptions::master)
      .def_readwrite("engine", &EmbeddedClusterOptions::engine);
}

// The pointer-list forms' binding (batch_put_from_ptrs, batch_get_into_ptrs): the lists are
// read natively (None when they need the Python side's checked path), `call` runs on the
// client without the GIL, `reply` shapes its result for Python.
template <typename Call, typename Reply>
auto PtrBatchCall(bool unique_keys, Call call, Reply reply) {
  return [=](PyStoreClient& c, const py::handle& keys, const py::handle& addrs,
             const py::handle& lens, bool multi) -> py::object {
    ScratchBatch scratch;  // this thread's: the GIL is released below, but not re-entered
    if (!ReadPtrBatch(keys, addrs, lens, multi, unique_keys, scratch.batch)) return py::none();
    auto r = NoGil([&] { return c.With([&](StoreClient& s) { return call(s, scratch.batch); }); });
    return reply(r);
  };
}

void BindClient(py::module_& m) {
  py::class_<PyStoreClient, std::shared_ptr<PyStoreClient>>(m, "StoreClient")
      .def(py::init([](const StoreOptions& o) {
             auto c = NoGil([&] { return Unwrap(StoreClient::Create(o)); });
             return std::make_shared<PyStoreClient>(std::move(c));
           }),
           py::arg("options"))
      .def("close", [](PyStoreClient& c) { NoGil([&] { c.Close(); }); })
      .def(
          "register_buffer",
          [](PyStoreClient& c, uintptr_t addr, uint64_t len, int kind, int device) {
            NoGil([&] {
              c.With([&](StoreClient& s) {
                ThrowIfError(s.RegisterBuffer(reinterpret_cast<void*>(addr), len,
                                              static_cast<MemoryKind>(kind), device));
              });
            });
          },
          py::arg("addr"), py::arg("len"), py::arg("kind") = static_cast<int>(MemoryKind::kHost),
          py::arg("device") = -1)
      .def("unregister_buffer",
           [](PyStoreClient& c, uintptr_t addr) {
             NoGil([&] {
               c.With([&](StoreClient& s) {
                 ThrowIfError(s.UnregisterBuffer(reinterpret_cast<void*>(addr)));
               });
             });
           })
      .def("batch_put_from",
           [](PyStoreClient& c, const std::vector<std::string>& keys,
              const std::vector<PyBuffers>& buffers) {
             CheckSameLength(keys.size(), buffers.size());
             auto bufs = ToBuffers(buffers);
             auto st = NoGil([&] {
               return c.With([&](StoreClient& s) { return s.BatchPutFrom(keys, bufs); });
             });
             return ToPy(st);
           })
      .def("batch_upsert_from",
           [](PyStoreClient& c, const std::vector<std::string>& keys,
              const std::vector<PyBuffers>& buffers) {
             CheckSameLength(keys.size(), buffers.size());
             auto bufs = ToBuffers(buffers);
             auto st = NoGil([&] {
               return c.With([&](StoreClient& s) { return s.BatchUpsertFrom(keys, bufs); });
             });
             return ToPy(st);
           })
      .def("batch_get_into",
           [](PyStoreClient& c, const std::vector<std::string>& keys,
              const std::vector<PyBuffers>& buffers) {
             CheckSameLength(keys.size(), buffers.size());
             auto bufs = ToBuffers(buffers);
             return ToPy(NoGil([&] {
               return c.With([&](StoreClient& s) { return s.BatchGetInto(keys, bufs); });
             }));
           })
      .def("batch_put_from_ptrs",
           PtrBatchCall(
               /*unique_keys=*/true,
               [](StoreClient& s, const PtrBatch& b) { return s.BatchPutFrom(b.keys, b.buffers); },
               [](const std::vector<Status>& st) -> py::object { return Failures(st); }))
      .def("batch_upsert_from_ptrs",
           PtrBatchCall(
               /*unique_keys=*/true,
               [](StoreClient& s, const PtrBatch& b) {
                 return s.BatchUpsertFrom(b.keys, b.buffers);
               },
               [](const std::vector<Status>& st) -> py::object { return Failures(st); }))
      .def("batch_get_into_ptrs",
           PtrBatchCall(
               /*unique_keys=*/false,
               [](StoreClient& s, const PtrBatch& b) { return s.BatchGetInto(b.keys, b.buffers); },
               [](const std::vector<Result<uint64_t>>& rs) -> py::object {
                 py::list sizes(rs.size());
                 py::dict failed;
                 for (size_t i = 0; i < rs.size(); ++i) {
                   sizes[i] = py::int_(rs[i].ok() ? rs[i].value() : 0);
                   if (!rs[i].ok()) failed[py::int_(i)] = py::cast(bindings::ToPy(rs[i].status()));
                 }
                 return py::make_tuple(std::move(sizes), std::move(failed));
               }))
      .def("batch_get_size",
           [](PyStoreClient& c, const std::vector<std::string>& keys) {
             return ToPy(NoGil(
                 [&] { return c.With([&](StoreClient& s) { return s.BatchGetSize(keys); }); }));
           })
      .def("batch_replica_info",
           [](PyStoreClient& c, const std::vector<std::string>& keys) {
             auto rs = NoGil([&] {
               return c.With([&](StoreClient& s) { return s.BatchGetReplicaInfo(keys); });
             });
             py::list out(rs.size());
             for (size_t i = 0; i < rs.size(); ++i) {
               py::list reps;
               if (rs[i].ok()) {
                 for (const ReplicaInfo& r : rs[i].value()) {
                   reps.append(py::make_tuple(r.node.node_id, r.node.incarnation, r.on_ssd,
                                              r.segment_id, r.offset, r.bytes));
                 }
               }
               out[i] = py::make_tuple(rs[i].ok() ? PyStatus{} : bindings::ToPy(rs[i].status()),
                                       std::move(reps));
             }
             return out;
           })
      .def("batch_exists",
           [](PyStoreClient& c, const std::vector<std::string>& keys) {
             return NoGil([&] {
               return c.With([&](StoreClient& s) { return Unwrap(s.BatchExists(keys)); });
             });
           })
      .def("batch_remove",
           [](PyStoreClient& c, const std::vector<std::string>& keys) {
             auto st =
                 NoGil([&] { return c.With([&](StoreClient& s) { return s.BatchRemove(keys); }); });
             return ToPy(st);
           })
      .def("remove_all",
           [](PyStoreClient& c) {
             NoGil([&] { c.With([](StoreClient& s) { ThrowIfError(s.RemoveAll()); }); });
           })
      .def("remove_by_regex",
           [](PyStoreClient& c, const std::string& pattern) {
             return NoGil([&] {
               return c.With([&](StoreClient& s) { return Unwrap(s.RemoveByRegex(pattern)); });
             });
           })
      .def("copy_object",
           [](PyStoreClient& c, const std::string& key, const std::vector<std::string>& to) {
             return NoGil([&] {
               return c.With([&](StoreClient& s) { return Unwrap(s.CopyObject(key, to)); });
             });
           })
      .def("move_object",
           [](PyStoreClient& c, const std::string& key, const std::string& from,
              const std::string& to) {
             return NoGil([&] {
               return c.With([&](StoreClient& s) { return Unwrap(s.MoveObject(key, from, to)); });
             });
           })
      .def("query_task",
           [](PyStoreClient& c, uint64_t id) {
             PlacementTask t = NoGil(
                 [&] { return c.With([&](StoreClient& s) { return Unwrap(s.QueryTask(id)); }); });
             py::dict d;
             d["key"] = py::bytes(t.key);
             d["move"] = t.move;
             d["state"] = t.state;
             d["message"] = t.message;
             d["source"] = t.source;
             d["created_unix_ms"] = t.created_unix_ms;
             d["updated_unix_ms"] = t.updated_unix_ms;
             return d;
           })
      .def("stats",
           [](PyStoreClient& c) {
             StoreClientStats s =
                 NoGil([&] { return c.With([](StoreClient& s) { return s.stats(); }); });
             return ToPy(s);
           })
      .def("reset_stats",
           [](PyStoreClient& c) { NoGil([&] { c.With([](StoreClient& s) { s.ResetStats(); }); }); })
      .def("put",
           [](PyStoreClient& c, const std::string& key, uintptr_t addr, uint64_t len) {
             std::string_view value(reinterpret_cast<const char*>(addr), len);
             NoGil([&] { c.With([&](StoreClient& s) { ThrowIfError(s.Put(key, value)); }); });
           })
      .def("upsert",
           [](PyStoreClient& c, const std::string& key, uintptr_t addr, uint64_t len) {
             std::string_view value(reinterpret_cast<const char*>(addr), len);
             NoGil([&] { c.With([&](StoreClient& s) { ThrowIfError(s.Upsert(key, value)); }); });
           })
      .def("get", [](PyStoreClient& c, const std::string& key) {
        std::string v =
            NoGil([&] { return c.With([&](StoreClient& s) { return Unwrap(s.Get(key)); }); });
        return py::bytes(v);
      });
}

void BindServers(py::module_& m) {
  py::class_<MasterHandle, std::shared_ptr<MasterHandle>>(m, "Master")
      .def(py::init([](const MasterOptions& o) {
             auto s = NoGil([&] { return Unwrap(MasterServer::Start(o)); });
             return std::make_shared<MasterHandle>(std::move(s), "Master");
           }),
           py::arg("options"))
      .def("close", [](MasterHandle& h) { NoGil([&] { h.Close(); }); })
      .def("address",
           [](MasterHandle& h) {
             return NoGil([&] { return h.With([](MasterServer& s) { return s.address(); }); });
           })
      .def("metrics_address", [](MasterHandle& h) {
        return NoGil([&] { return h.With([](MasterServer& s) { return s.metrics_address(); }); });
      });

  py::class_<NodeHandle, std::shared_ptr<NodeHandle>>(m, "Node")
      .def(py::init([](const NodeOptions& o) {
             auto n = NoGil([&] { return Unwrap(StorageNode::Start(o)); });
             return std::make_shared<NodeHandle>(std::move(n), "Node");
           }),
           py::arg("options"))
      .def("close", [](NodeHandle& h) { NoGil([&] { h.Close(); }); })
      .def("id",
           [](NodeHandle& h) {
             PeerId id = NoGil([&] { return h.With([](StorageNode& n) { return n.id(); }); });
             return py::make_tuple(id.node_id, id.incarnation);
           })
      .def("drain",
           [](NodeHandle& h) {
             NoGil([&] { h.With([](StorageNode& n) { ThrowIfError(n.Drain()); }); });
           })
      .def("ssd_status",
           [](NodeHandle& h) {
             Status st =
                 NoGil([&] { return h.With([](StorageNode& n) { return n.ssd_status(); }); });
             return bindings::ToPy(st);
           })
      .def("object_count",
           [](NodeHandle& h) {
             return NoGil([&] { return h.With([](StorageNode& n) { return n.object_count(); }); });
           })
      .def("metrics_address", [](NodeHandle& h) {
        return NoGil([&] { return h.With([](StorageNode& n) { return n.metrics_address(); }); });
      });

  py::class_<ClusterHandle, std::shared_ptr<ClusterHandle>>(m, "Cluster")
      .def(py::init([](const EmbeddedClusterOptions& o) {
             auto c = NoGil([&] { return Unwrap(EmbeddedCluster::Start(o)); });
             return std::make_shared<ClusterHandle>(std::move(c), "Cluster");
           }),
           py::arg("options"))
      .def("close", [](ClusterHandle& h) { NoGil([&] { h.Close(); }); })
      .def("master_address",
           [](ClusterHandle& h) {
             return NoGil(
                 [&] { return h.With([](EmbeddedCluster& c) { return c.master_address(); }); });
           })
      .def("client",
           [](const std::shared_ptr<ClusterHandle>& h) {
             NoGil([&] { h->With([](EmbeddedCluster&) {}); });  // fails if closed
             return std::make_shared<PyStoreClient>(h);
           })
      .def("node_count",
           [](ClusterHandle& h) {
             return NoGil(
                 [&] { return h.With([](EmbeddedCluster& c) { return c.nodes().size(); }); });
           })
      .def("node_id",
           [](ClusterHandle& h, size_t i) {
             PeerId id =
                 NoGil([&] { return h.WithNode(i, [](StorageNode& n) { return n.id(); }); });
             return py::make_tuple(id.node_id, id.incarnation);
           })
      .def("node_object_count",
           [](ClusterHandle& h, size_t i) {
             return NoGil(
                 [&] { return h.WithNode(i, [](StorageNode& n) { return n.object_count(); }); });
           })
      .def("drain_node",
           [](ClusterHandle& h, size_t i) {
             NoGil([&] { h.WithNode(i, [](StorageNode& n) { ThrowIfError(n.Drain()); }); });
           })
      .def("stop_node", [](ClusterHandle& h, size_t i) {
        NoGil([&] { h.TakeNode(i).reset(); });  // destroyed with no lock held
      });

  m.def(
      "query_cluster_status",
      [](const std::string& master, uint32_t timeout_ms, const std::string& cluster_token) {
        ClusterStatus cs =
            NoGil([&] { return Unwrap(QueryClusterStatus(master, timeout_ms, cluster_token)); });
        return ToPy(cs);
      },
      py::arg("master"), py::arg("timeout_ms") = 3000, py::arg("cluster_token") = "");
}

}  // namespace

void BindStore(py::module_& m) {
  BindOptions(m);
  BindClient(m);
  BindServers(m);
}

}  // namespace kvbridge::bindings
