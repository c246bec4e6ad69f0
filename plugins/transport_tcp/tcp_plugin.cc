// The tcp plugin's ABI glue: the descriptor, the ops table, and a catch at every entry so no
// C++ exception crosses the ABI.
#include <exception>
#include <memory>
#include <string>
#include <type_traits>

#include "kvbridge/plugin/transport.h"
#include "tcp_transport.h"

namespace {

using kvbridge::tcp::Peer;
using kvbridge::tcp::RequestHandle;
using kvbridge::tcp::Transport;

Transport* T(kvb_transport_t* t) { return reinterpret_cast<Transport*>(t); }
Peer* P(kvb_tpeer_t* p) { return reinterpret_cast<Peer*>(p); }
RequestHandle* R(kvb_treq_t* r) { return reinterpret_cast<RequestHandle*>(r); }

// Runs `fn`; an escaping exception becomes `on_error` (and its text goes to err when given).
template <typename Fn, typename Ret = std::invoke_result_t<Fn>>
Ret Guard(Fn&& fn, std::type_identity_t<Ret> on_error, char* err = nullptr, uint32_t err_len = 0) {
  try {
    return fn();
  } catch (const std::exception& e) {
    kvb_copy_message(err, err_len, (std::string("tcp: internal error: ") + e.what()).c_str());
  } catch (...) {
    kvb_copy_message(err, err_len, "tcp: internal error");
  }
  return on_error;
}

// For ops that return nothing: there is no channel to report an escaping exception on.
template <typename Fn>
void GuardVoid(Fn&& fn) {
  try {
    fn();
  } catch (...) {
  }
}

kvb_status_t Create(const kvb_host_services_t* host, const kvb_transport_params_t* params,
                    kvb_transport_t** out, char* err, uint32_t err_len) {
  return Guard(
      [&]() -> kvb_status_t {
        std::unique_ptr<Transport> t;
        std::string msg;
        const kvb_status_t st = Transport::Create(host, params, &t, &msg);
        if (st != KVB_OK || out == nullptr) {
          kvb_copy_message(err, err_len, out == nullptr ? "create: out is null" : msg.c_str());
          return st != KVB_OK ? st : KVB_ERR_INVALID_ARGUMENT;
        }
        *out = reinterpret_cast<kvb_transport_t*>(t.release());
        return KVB_OK;
      },
      KVB_ERR_INTERNAL, err, err_len);
}

void Destroy(kvb_transport_t* t) {
  GuardVoid([&] { delete T(t); });
}

int32_t GetEndpoints(kvb_transport_t* t, char* buf, uint32_t len) {
  return Guard([&] { return T(t)->GetEndpoints(buf, len); }, -2);
}

kvb_status_t RegisterMemory(kvb_transport_t* t, const kvb_region_t* region, uint8_t* rkey,
                            uint32_t rkey_cap, uint32_t* rkey_len) {
  return Guard([&] { return T(t)->RegisterMemory(region, rkey, rkey_cap, rkey_len); },
               KVB_ERR_INTERNAL);
}

kvb_status_t DeregisterMemory(kvb_transport_t* t, uint64_t segment_id) {
  return Guard([&] { return T(t)->DeregisterMemory(segment_id); }, KVB_ERR_INTERNAL);
}

kvb_status_t AddPeer(kvb_transport_t* t, const kvb_peer_info_t* info, kvb_tpeer_t** out, char* err,
                     uint32_t err_len) {
  return Guard(
      [&]() -> kvb_status_t {
        Peer* peer = nullptr;
        std::string msg;
        const kvb_status_t st = T(t)->AddPeer(info, &peer, &msg);
        if (st == KVB_OK)
          *out = reinterpret_cast<kvb_tpeer_t*>(peer);
        else
          kvb_copy_message(err, err_len, msg.c_str());
        return st;
      },
      KVB_ERR_INTERNAL, err, err_len);
}

kvb_status_t UpdatePeer(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_peer_info_t* info,
                        char* err, uint32_t err_len) {
  return Guard(
      [&]() -> kvb_status_t {
        std::string msg;
        const kvb_status_t st = T(t)->UpdatePeer(P(peer), info, &msg);
        if (st != KVB_OK) kvb_copy_message(err, err_len, msg.c_str());
        return st;
      },
      KVB_ERR_INTERNAL, err, err_len);
}

void RemovePeer(kvb_transport_t* t, kvb_tpeer_t* peer) {
  GuardVoid([&] { T(t)->RemovePeer(P(peer)); });
}

kvb_status_t Post(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_xfer_op_t* ops, uint32_t op_size,
                  uint32_t count, const kvb_post_opts_t* opts, kvb_treq_t** out, char* err,
                  uint32_t err_len) {
  return Guard(
      [&]() -> kvb_status_t {
        RequestHandle* h = nullptr;
        std::string msg;
        const kvb_status_t st = T(t)->Post(P(peer), ops, op_size, count, opts, &h, &msg);
        if (st == KVB_OK)
          *out = reinterpret_cast<kvb_treq_t*>(h);
        else
          kvb_copy_message(err, err_len, msg.c_str());
        return st;
      },
      KVB_ERR_INTERNAL, err, err_len);
}

kvb_status_t Poll(kvb_transport_t* t, kvb_treq_t* req, kvb_status_t* op_status,
                  uint32_t op_status_len, char* err, uint32_t err_len) {
  return Guard([&] { return T(t)->Poll(R(req), op_status, op_status_len, err, err_len); },
               KVB_ERR_INTERNAL, err, err_len);
}

void Cancel(kvb_transport_t* t, kvb_treq_t* req) {
  GuardVoid([&] { T(t)->Cancel(R(req)); });
}

void Release(kvb_transport_t* t, kvb_treq_t* req) {
  GuardVoid([&] { T(t)->Release(R(req)); });
}

kvb_status_t GetStats(kvb_transport_t* t, kvb_transport_stats_t* stats) {
  return Guard([&] { return T(t)->GetStats(stats); }, KVB_ERR_INTERNAL);
}

kvb_status_t Probe(char* reason, uint32_t reason_len) {
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
    .name = "tcp",
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
