// The ucx plugin's ABI glue: the descriptor, the ops table, and a catch at every entry so no
// C++ exception crosses the ABI. The work is in ucx_transport.cc and ucx_worker.cc.
#include <ucp/api/ucp.h>

#include <memory>
#include <string>

#include "guard.h"
#include "kvbridge/plugin/transport.h"
#include "ucx_transport.h"

namespace {

using kvbridge::plugin::Guard;
using kvbridge::ucx::Peer;
using kvbridge::ucx::RequestHandle;
using kvbridge::ucx::Transport;

constexpr char kName[] = "ucx";

Transport* T(kvb_transport_t* t) { return reinterpret_cast<Transport*>(t); }

// For ops that return no status: nothing may escape, and there is no channel to report on.
template <typename Fn>
void Quiet(Fn&& fn) {
  try {
    fn();
  } catch (...) {
  }
}

// Runs an op that reports through (std::string* msg): its message goes to err on failure.
template <typename Fn>
kvb_status_t WithMessage(Fn&& fn, char* err, uint32_t err_len) {
  return Guard(
      kName,
      [&]() -> kvb_status_t {
        std::string msg;
        const kvb_status_t st = fn(&msg);
        if (st != KVB_OK) kvb_copy_message(err, err_len, msg.c_str());
        return st;
      },
      err, err_len);
}

kvb_status_t Create(const kvb_host_services_t* host, const kvb_transport_params_t* params,
                    kvb_transport_t** out, char* err, uint32_t err_len) {
  return WithMessage(
      [&](std::string* msg) -> kvb_status_t {
        if (out == nullptr) {
          *msg = "ucx: create: out is null";
          return KVB_ERR_INVALID_ARGUMENT;
        }
        std::unique_ptr<Transport> t;
        const kvb_status_t st = Transport::Create(host, params, &t, msg);
        if (st == KVB_OK) *out = reinterpret_cast<kvb_transport_t*>(t.release());
        return st;
      },
      err, err_len);
}

void Destroy(kvb_transport_t* t) {
  Quiet([&] { delete T(t); });
}

int32_t GetEndpoints(kvb_transport_t* t, char* buf, uint32_t len) {
  int32_t n = -2;
  Quiet([&] { n = T(t)->GetEndpoints(buf, len); });
  return n;
}

kvb_status_t RegisterMemory(kvb_transport_t* t, const kvb_region_t* region, uint8_t* rkey,
                            uint32_t rkey_cap, uint32_t* rkey_len) {
  return Guard(kName, [&] { return T(t)->RegisterMemory(region, rkey, rkey_cap, rkey_len); });
}

kvb_status_t DeregisterMemory(kvb_transport_t* t, uint64_t segment_id) {
  return Guard(kName, [&] { return T(t)->DeregisterMemory(segment_id); });
}

kvb_status_t AddPeer(kvb_transport_t* t, const kvb_peer_info_t* info, kvb_tpeer_t** out, char* err,
                     uint32_t err_len) {
  return WithMessage(
      [&](std::string* msg) {
        Peer* peer = nullptr;
        const kvb_status_t st = T(t)->AddPeer(info, &peer, msg);
        if (st == KVB_OK) *out = reinterpret_cast<kvb_tpeer_t*>(peer);
        return st;
      },
      err, err_len);
}

kvb_status_t UpdatePeer(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_peer_info_t* info,
                        char* err, uint32_t err_len) {
  return WithMessage(
      [&](std::string* msg) { return T(t)->UpdatePeer(reinterpret_cast<Peer*>(peer), info, msg); },
      err, err_len);
}

void RemovePeer(kvb_transport_t* t, kvb_tpeer_t* peer) {
  Quiet([&] { T(t)->RemovePeer(reinterpret_cast<Peer*>(peer)); });
}

kvb_status_t Post(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_xfer_op_t* ops, uint32_t op_size,
                  uint32_t count, const kvb_post_opts_t* opts, kvb_treq_t** out, char* err,
                  uint32_t err_len) {
  return WithMessage(
      [&](std::string* msg) {
        RequestHandle* h = nullptr;
        const kvb_status_t st =
            T(t)->Post(reinterpret_cast<Peer*>(peer), ops, op_size, count, opts, &h, msg);
        if (st == KVB_OK) *out = reinterpret_cast<kvb_treq_t*>(h);
        return st;
      },
      err, err_len);
}

kvb_status_t Poll(kvb_transport_t* t, kvb_treq_t* req, kvb_status_t* op_status,
                  uint32_t op_status_len, char* err, uint32_t err_len) {
  return Guard(
      kName,
      [&] {
        return T(t)->Poll(reinterpret_cast<RequestHandle*>(req), op_status, op_status_len, err,
                          err_len);
      },
      err, err_len);
}

void Cancel(kvb_transport_t* t, kvb_treq_t* req) {
  Quiet([&] { T(t)->Cancel(reinterpret_cast<RequestHandle*>(req)); });
}

void Release(kvb_transport_t* t, kvb_treq_t* req) {
  Quiet([&] { T(t)->Release(reinterpret_cast<RequestHandle*>(req)); });
}

kvb_status_t GetStats(kvb_transport_t* t, kvb_transport_stats_t* stats) {
  return Guard(kName, [&] { return T(t)->GetStats(stats); });
}

kvb_status_t Probe(char* reason, uint32_t reason_len) {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (major < 1 || (major == 1 && minor < 13)) {
    const std::string why = "UCX " + std::to_string(major) + "." + std::to_string(minor) +
                            " is loaded; the ucx transport needs 1.13 or newer";
    kvb_copy_message(reason, reason_len, why.c_str());
    return KVB_ERR_UNAVAILABLE;
  }
  kvb_copy_message(reason, reason_len, "");
  return KVB_OK;
}

const kvb_transport_ops_t kOps = {
    .struct_size = sizeof(kvb_transport_ops_t),
    .create = Create,
    .destroy = Destroy,
    .get_endpoints = GetEndpoints,
    .register_memory = RegisterMemory,
    .deregister_memory = DeregisterMemory,
    .add_peer = AddPeer,
    .update_peer = UpdatePeer,
    .remove_peer = RemovePeer,
    .post = Post,
    .poll = Poll,
    .cancel = Cancel,
    .release = Release,
    .get_stats = GetStats,
};

const kvb_plugin_descriptor_t kDescriptor = {
    .struct_size = sizeof(kvb_plugin_descriptor_t),
    .abi_major = KVB_ABI_MAJOR,
    .abi_minor = KVB_ABI_MINOR,
    .name = kName,
    .version = "0.1.0",
    .kind = KVB_PLUGIN_TRANSPORT,
    .reserved = 0,
    .caps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM | KVB_TCAP_STATS,
    .probe = Probe,
    .ops = &kOps,
};

}  // namespace

extern "C" KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(
    uint16_t host_abi_major, uint16_t host_abi_minor) {
  (void)host_abi_minor;
  return host_abi_major == KVB_ABI_MAJOR ? &kDescriptor : nullptr;
}
