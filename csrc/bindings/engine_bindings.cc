// Bindings of TransferEngine and EngineOptions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/common.h"
#include "kvbridge/engine.h"
#include "kvbridge/options.h"

namespace kvbridge::bindings {
namespace {

using EngineHandle = Handle<TransferEngine>;
// (opcode, local address, length, peer node id, remote segment, remote offset)
using PyOp = std::tuple<int, uintptr_t, uint64_t, std::string, uint64_t, uint64_t>;

py::tuple ToPy(const BatchResult& r) {
  std::vector<PyStatus> ops;
  ops.reserve(r.op_status.size());
  for (const auto& s : r.op_status) ops.push_back(bindings::ToPy(s));
  return py::make_tuple(bindings::ToPy(r.status), ops);
}

std::vector<TransferOp> ToOps(const std::vector<PyOp>& in) {
  std::vector<TransferOp> ops;
  ops.reserve(in.size());
  for (const auto& [opcode, addr, len, peer, seg, off] : in) {
    if (opcode != static_cast<int>(OpCode::kRead) && opcode != static_cast<int>(OpCode::kWrite)) {
      throw StatusError(Status::InvalidArgument("opcode " + std::to_string(opcode) +
                                                " is neither READ (1) nor WRITE (2)"));
    }
    ops.push_back(TransferOp{static_cast<OpCode>(opcode), reinterpret_cast<void*>(addr), len, peer,
                             seg, off});
  }
  return ops;
}

// (segment id, base address, length) of a peer's registered memory, as the Mooncake layer
// caches it.
using PySegment = std::tuple<uint64_t, uint64_t, uint64_t>;

// One batch to one peer given as Mooncake's pointer lists (local addresses, the peer's
// addresses, lengths), read without a Python object per op: at hundreds of ops per call the
// tuple path cost about 0.5 us per op. nullopt unless the three are non-empty lists of one
// length of positive plain ints and every remote range lies inside one of the peer's
// segments; the caller then takes its general path (which names what is wrong, or re-reads
// the peer's segments).
std::optional<std::vector<TransferOp>> ReadPtrOps(int opcode, const std::string& peer,
                                                  const std::vector<PySegment>& segments,
                                                  const py::handle& locals,
                                                  const py::handle& remotes,
                                                  const py::handle& lens) {
  if (opcode != static_cast<int>(OpCode::kRead) && opcode != static_cast<int>(OpCode::kWrite)) {
    throw StatusError(Status::InvalidArgument("opcode " + std::to_string(opcode) +
                                              " is neither READ (1) nor WRITE (2)"));
  }
  if (!PyList_CheckExact(locals.ptr()) || !PyList_CheckExact(remotes.ptr()) ||
      !PyList_CheckExact(lens.ptr())) {
    return std::nullopt;
  }
  const Py_ssize_t n = PyList_GET_SIZE(locals.ptr());
  if (n == 0 || PyList_GET_SIZE(remotes.ptr()) != n || PyList_GET_SIZE(lens.ptr()) != n) {
    return std::nullopt;
  }
  std::vector<TransferOp> ops;
  ops.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const auto l = PositiveInt(PyList_GET_ITEM(locals.ptr(), i));
    const auto r = PositiveInt(PyList_GET_ITEM(remotes.ptr(), i));
    const auto n_bytes = PositiveInt(PyList_GET_ITEM(lens.ptr(), i));
    if (!l || !r || !n_bytes) return std::nullopt;
    const uint64_t local = *l, remote = *r, len = *n_bytes;
    const PySegment* in = nullptr;
    for (const auto& seg : segments) {
      const auto& [sid, base, seg_len] = seg;
      if (base <= remote && remote - base <= seg_len && len <= seg_len - (remote - base)) {
        in = &seg;
        break;
      }
    }
    if (in == nullptr) return std::nullopt;
    ops.push_back(TransferOp{static_cast<OpCode>(opcode), reinterpret_cast<void*>(local), len, peer,
                             std::get<0>(*in), remote - std::get<1>(*in)});
  }
  return ops;
}

// Submit, and for transfer() wait, with the GIL released.
BatchId SubmitOps(EngineHandle& h, const std::vector<TransferOp>& ops, const SubmitOptions& so) {
  return NoGil(
      [&] { return h.With([&](TransferEngine& e) { return Unwrap(e.Submit(ops, so)); }); });
}
BatchResult TransferOps(EngineHandle& h, const std::vector<TransferOp>& ops,
                        const SubmitOptions& so) {
  return NoGil([&] {
    return h.With([&](TransferEngine& e) {
      Result<BatchId> id = e.Submit(ops, so);
      if (!id.ok()) return BatchResult{id.status(), {}, {}};
      return e.Wait(*id);
    });
  });
}

// The pointer-list forms' binding (submit_ptrs, transfer_ptrs): the three lists are read
// natively, then `run` gets the ops; None when they need the Python side's checked path.
template <typename Run>
auto PtrOpsCall(Run run) {
  return [run](EngineHandle& h, int opcode, const std::string& peer,
               const std::vector<PySegment>& segments, const py::handle& locals,
               const py::handle& remotes, const py::handle& lens, uint32_t deadline_ms,
               uint32_t progress_timeout_ms) -> py::object {
    auto ops = ReadPtrOps(opcode, peer, segments, locals, remotes, lens);
    if (!ops) return py::none();
    return run(h, *ops, SubmitOptions{deadline_ms, progress_timeout_ms});
  };
}

const char* BreakerName(BreakerState s) {
  switch (s) {
    case BreakerState::kClosed:
      return "closed";
    case BreakerState::kOpen:
      return "open";
    case BreakerState::kHalfOpen:
      return "half_open";
  }
  return "unknown";
}

}  // namespace

void BindEngine(py::module_& m) {
  m.def(
      "fetch_descriptor",
      [](const std::string& host_port, uint32_t timeout_ms) {
        std::string d =
            NoGil([&] { return Unwrap(TransferEngine::FetchDescriptor(host_port, timeout_ms)); });
        return py::bytes(d);
      },
      py::arg("host_port"), py::arg("timeout_ms") = 3000);

  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_static("from_env", &EngineOptions::FromEnv)
      .def_readwrite("node_id", &EngineOptions::node_id)
      .def_readwrite("transports", &EngineOptions::transports)
      .def_readwrite("plugin_path", &EngineOptions::plugin_path)
      .def_readwrite("listen", &EngineOptions::listen)
      .def_readwrite("cluster_token", &EngineOptions::cluster_token)
      .def_readwrite("handshake_listen", &EngineOptions::handshake_listen)
      .def_readwrite("deadline_ms", &EngineOptions::default_deadline_ms)
      .def_readwrite("progress_timeout_ms", &EngineOptions::progress_timeout_ms)
      .def_readwrite("breaker_failures", &EngineOptions::breaker_failures)
      .def_readwrite("breaker_backoff_ms", &EngineOptions::breaker_backoff_ms)
      .def_readwrite("breaker_max_backoff_ms", &EngineOptions::breaker_max_backoff_ms)
      .def_readwrite("max_ops_per_batch", &EngineOptions::max_ops_per_batch)
      .def_readwrite("max_inflight_batches", &EngineOptions::max_inflight_batches)
      .def_readwrite("max_unpolled_batches", &EngineOptions::max_unpolled_batches)
      .def_readwrite("path_failover", &EngineOptions::path_failover)
      .def_readwrite("path_failover_writes", &EngineOptions::path_failover_writes)
      .def_readwrite("failover_min_budget_ms", &EngineOptions::failover_min_budget_ms)
      .def_readwrite("local_copy", &EngineOptions::local_copy)
      .def_readwrite("local_copy_threads", &EngineOptions::local_copy_threads)
      .def_readwrite("plugin_config", &EngineOptions::plugin_config);

  py::class_<EngineHandle, std::shared_ptr<EngineHandle>>(m, "TransferEngine")
      .def(py::init([](const EngineOptions& o) {
             auto engine = NoGil([&] { return Unwrap(TransferEngine::Create(o)); });
             return std::make_shared<EngineHandle>(std::move(engine), "TransferEngine");
           }),
           py::arg("options"))
      .def("close", [](EngineHandle& h) { NoGil([&] { h.Close(); }); })
      .def_property_readonly("closed",
                             [](EngineHandle& h) { return NoGil([&] { return h.closed(); }); })
      .def("self_id",
           [](EngineHandle& h) {
             PeerId id = NoGil([&] { return h.With([](TransferEngine& e) { return e.self(); }); });
             return py::make_tuple(id.node_id, id.incarnation);
           })
      .def("transports",
           [](EngineHandle& h) {
             return NoGil([&] { return h.With([](TransferEngine& e) { return e.transports(); }); });
           })
      .def("endpoints",
           [](EngineHandle& h, const std::string& transport) {
             return NoGil(
                 [&] { return h.With([&](TransferEngine& e) { return e.endpoints(transport); }); });
           })
      .def("register_memory",
           [](EngineHandle& h, uintptr_t addr, uint64_t length, int kind, int device) {
             return NoGil([&] {
               return h.With([&](TransferEngine& e) {
                 return Unwrap(e.RegisterMemory(reinterpret_cast<void*>(addr), length,
                                                static_cast<MemoryKind>(kind), device));
               });
             });
           })
      .def("deregister_memory",
           [](EngineHandle& h, SegmentId id) {
             NoGil(
                 [&] { h.With([&](TransferEngine& e) { ThrowIfError(e.DeregisterMemory(id)); }); });
           })
      .def("local_descriptor",
           [](EngineHandle& h) {
             std::string d = NoGil(
                 [&] { return h.With([](TransferEngine& e) { return e.LocalDescriptor(); }); });
             return py::bytes(d);
           })
      .def("add_peer",
           [](EngineHandle& h, const std::string& descriptor) {
             PeerId id = NoGil([&] {
               // Python's add_peer learns or replaces a peer as given (python/kvbridge/engine.py):
               // the caller chose the descriptor, so it may also move a known peer.
               AddPeerOptions o;
               o.allow_endpoint_change = true;
               return h.With([&](TransferEngine& e) { return Unwrap(e.AddPeer(descriptor, o)); });
             });
             return py::make_tuple(id.node_id, id.incarnation);
           })
      .def("handshake_endpoint",
           [](EngineHandle& h) {
             return NoGil(
                 [&] { return h.With([](TransferEngine& e) { return e.handshake_endpoint(); }); });
           })
      .def("peer_segments",
           [](EngineHandle& h, const std::string& node_id) {
             auto segs = NoGil([&] {
               return h.With([&](TransferEngine& e) { return Unwrap(e.PeerSegments(node_id)); });
             });
             std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> out;
             for (const auto& s : segs) out.emplace_back(s.id, s.base, s.length);
             return out;
           })
      .def(
          "remove_peer",
          [](EngineHandle& h, const std::string& node_id) {
            NoGil([&] { h.With([&](TransferEngine& e) { ThrowIfError(e.RemovePeer(node_id)); }); });
          })
      .def("submit",
           [](EngineHandle& h, const std::vector<PyOp>& in, uint32_t deadline_ms,
              uint32_t progress_timeout_ms) {
             return SubmitOps(h, ToOps(in), SubmitOptions{deadline_ms, progress_timeout_ms});
           })
      .def("poll",
           [](EngineHandle& h, BatchId id) -> py::object {
             auto r = NoGil([&] { return h.With([&](TransferEngine& e) { return e.Poll(id); }); });
             if (!r) return py::none();
             return ToPy(*r);
           })
      .def("wait",
           [](EngineHandle& h, BatchId id) {
             BatchResult r =
                 NoGil([&] { return h.With([&](TransferEngine& e) { return e.Wait(id); }); });
             return ToPy(r);
           })
      .def("cancel",
           [](EngineHandle& h, BatchId id) {
             NoGil([&] { h.With([&](TransferEngine& e) { e.Cancel(id); }); });
           })
      .def(
          "transfer",
          [](EngineHandle& h, const std::vector<PyOp>& in, uint32_t deadline_ms,
             uint32_t progress_timeout_ms) {
            return ToPy(TransferOps(h, ToOps(in), SubmitOptions{deadline_ms, progress_timeout_ms}));
          })
      .def("submit_ptrs", PtrOpsCall([](EngineHandle& h, const std::vector<TransferOp>& ops,
                                        const SubmitOptions& so) -> py::object {
             return py::int_(SubmitOps(h, ops, so));
           }))
      .def("transfer_ptrs", PtrOpsCall([](EngineHandle& h, const std::vector<TransferOp>& ops,
                                          const SubmitOptions& so) -> py::object {
             return ToPy(TransferOps(h, ops, so));
           }))
      .def("peer_health",
           [](EngineHandle& h, const std::string& node_id) -> py::object {
             auto ph = NoGil([&] {
               return h.With([&](TransferEngine& e) { return e.GetPeerHealth(node_id); });
             });
             if (!ph) return py::none();
             py::dict d;
             d["node_id"] = ph->id.node_id;
             d["incarnation"] = ph->id.incarnation;
             d["transport"] = ph->transport;
             d["breaker"] = BreakerName(ph->breaker);
             d["consecutive_failures"] = ph->consecutive_failures;
             d["fast_failed_ops"] = ph->fast_failed_ops;
             d["stale"] = ph->stale;
             d["local_copy_ops"] = ph->local_copy_ops;
             py::list paths;
             for (const PathHealth& p : ph->paths) {
               py::dict pd;
               pd["transport"] = p.transport;
               pd["breaker"] = BreakerName(p.breaker);
               pd["consecutive_failures"] = p.consecutive_failures;
               pd["ops_ok"] = p.ops_ok;
               pd["ops_failed"] = p.ops_failed;
               pd["fast_failed"] = p.fast_failed;
               pd["failed_over_from"] = p.failed_over_from;
               paths.append(pd);
             }
             d["paths"] = paths;
             return d;
           })
      .def("transport_stats", [](EngineHandle& h, const std::string& name) {
        TransportStats s = NoGil([&] {
          return h.With([&](TransferEngine& e) { return Unwrap(e.GetTransportStats(name)); });
        });
        py::dict d;
        d["name"] = s.name;
        d["connections_open"] = s.connections_open;
        d["connections_opened"] = s.connections_opened;
        d["connections_closed_idle"] = s.connections_closed_idle;
        d["connections_evicted"] = s.connections_evicted;
        d["inbound_open"] = s.inbound_open;
        d["bytes_written"] = s.bytes_written;
        d["bytes_read"] = s.bytes_read;
        d["frames_rejected"] = s.frames_rejected;
        d["queued_bytes"] = s.queued_bytes;
        d["device_regions_direct"] = s.device_regions_direct;
        d["device_regions_staged"] = s.device_regions_staged;
        d["device_bytes_staged"] = s.device_bytes_staged;
        return d;
      });
}

}  // namespace kvbridge::bindings
