#include "core/host_services.h"

#include <cctype>
#include <cstdlib>
#include <cstring>

#include "util/clock.h"
#include "util/logging.h"

namespace kvbridge::core {
namespace {

void HostLog(void* ctx, int32_t level, const char* plugin, const char* msg) {
  if (const auto& sink = static_cast<const HostServices*>(ctx)->sink()) {
    sink(level, plugin ? plugin : "plugin", msg ? msg : "");
    return;
  }
  auto lvl = static_cast<util::LogLevel>(level < 0 ? 0 : (level > 3 ? 3 : level));
  if (!util::LogEnabled(lvl)) return;
  util::LogLine(lvl, plugin ? plugin : "plugin", msg ? msg : "");
}

int32_t HostConfigGet(void* ctx, const char* key, char* buf, uint32_t buf_len) {
  if (key == nullptr) return -1;
  auto value = static_cast<const HostServices*>(ctx)->Get(key);
  if (!value) return -1;
  if (buf == nullptr || value->size() + 1 > buf_len) return -2;
  std::memcpy(buf, value->c_str(), value->size() + 1);
  return static_cast<int32_t>(value->size());
}

uint64_t HostNowNs(void*) { return util::MonoNs(); }

// ---- ABI 1.2: identity and the peer handshake ----------------------------------------------

const auth::Identity* IdentityOf(void* ctx) {
  const auto& id = static_cast<const HostServices*>(ctx)->identity();
  return id ? &*id : nullptr;
}

const char* HostNodeId(void* ctx) {
  const auth::Identity* id = IdentityOf(ctx);
  return id ? id->node_id.c_str() : "";
}

uint64_t HostIncarnation(void* ctx) {
  const auth::Identity* id = IdentityOf(ctx);
  return id ? id->incarnation : 0;
}

// kvb_auth_t is an auth::Session; the opaque C type exists only so plugins cannot look inside.
auth::Session* SessionOf(kvb_auth_t* a) { return reinterpret_cast<auth::Session*>(a); }

kvb_status_t HostAuthBegin(void* ctx, const char* transport, int32_t role,
                           const char* expected_node_id, uint64_t expected_incarnation,
                           kvb_auth_t** out, char* err, uint32_t err_len) {
  const auth::Identity* id = IdentityOf(ctx);
  if (id == nullptr) {
    kvb_copy_message(err, err_len, "auth_begin: this host has no identity (only a transfer engine's "
                                   "plugins authenticate peers)");
    return KVB_ERR_UNAVAILABLE;
  }
  if (out == nullptr || transport == nullptr || transport[0] == '\0' ||
      (role != KVB_AUTH_CLIENT && role != KVB_AUTH_SERVER)) {
    kvb_copy_message(err, err_len,
                     "auth_begin: needs a transport name, role KVB_AUTH_CLIENT or "
                     "KVB_AUTH_SERVER and an out pointer");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  const bool client = role == KVB_AUTH_CLIENT;
  if (client && (expected_node_id == nullptr || expected_node_id[0] == '\0' ||
                 std::strlen(expected_node_id) > auth::kMaxNodeIdBytes)) {
    kvb_copy_message(err, err_len, "auth_begin: a client must name the peer's node id (1..255 bytes)");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  try {
    *out = reinterpret_cast<kvb_auth_t*>(
        new auth::Session(*id, transport, client ? auth::Role::kClient : auth::Role::kServer,
                          client ? expected_node_id : "", client ? expected_incarnation : 0));
  } catch (const std::exception& e) {
    kvb_copy_message(err, err_len, e.what());
    return KVB_ERR_INTERNAL;
  }
  return KVB_OK;
}

int32_t HostAuthNeed(void*, kvb_auth_t* a, const uint8_t* buf, uint32_t have) {
  if (a == nullptr || (buf == nullptr && have != 0)) return -1;
  return SessionOf(a)->Need(buf, have);
}

kvb_status_t HostAuthStep(void*, kvb_auth_t* a, const uint8_t* in, uint32_t in_len, uint8_t* out,
                          uint32_t out_cap, uint32_t* out_len, char* err, uint32_t err_len) {
  if (a == nullptr || out_len == nullptr || (out == nullptr && out_cap != 0)) {
    kvb_copy_message(err, err_len, "auth_step: no session or no out_len");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  *out_len = 0;
  std::string msg, why;
  kvb_status_t st;
  try {
    st = SessionOf(a)->Step(in, in_len, &msg, &why);
  } catch (const std::exception& e) {
    kvb_copy_message(err, err_len, e.what());
    return KVB_ERR_INTERNAL;
  }
  if (msg.size() > out_cap) {
    kvb_copy_message(err, err_len, "auth_step: out_cap is below KVB_AUTH_MAX_MESSAGE");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::memcpy(out, msg.data(), msg.size());
  *out_len = static_cast<uint32_t>(msg.size());
  if (st != KVB_OK && st != KVB_IN_PROGRESS) kvb_copy_message(err, err_len, why.c_str());
  return st;
}

kvb_status_t HostAuthPeer(void*, kvb_auth_t* a, char* node_id, uint32_t cap,
                          uint64_t* incarnation) {
  if (a == nullptr || !SessionOf(a)->authenticated()) return KVB_ERR_UNAUTHENTICATED;
  kvb_copy_message(node_id, cap, SessionOf(a)->peer_node_id().c_str());
  if (incarnation != nullptr) *incarnation = SessionOf(a)->peer_incarnation();
  return KVB_OK;
}

void HostAuthEnd(void*, kvb_auth_t* a) { delete SessionOf(a); }

}  // namespace

HostServices::HostServices(std::map<std::string, std::string> config,
                           std::optional<auth::Identity> identity, LogSink sink)
    : config_(std::move(config)), identity_(std::move(identity)), sink_(std::move(sink)) {
  table_ = kvb_host_services_t{
      .struct_size = sizeof(kvb_host_services_t),
      .host_ctx = this,
      .log = HostLog,
      .config_get = HostConfigGet,
      .now_ns = HostNowNs,
      .node_id = HostNodeId,
      .incarnation = HostIncarnation,
      .auth_begin = HostAuthBegin,
      .auth_need = HostAuthNeed,
      .auth_step = HostAuthStep,
      .auth_peer = HostAuthPeer,
      .auth_end = HostAuthEnd,
  };
}

std::string HostServices::EnvName(const std::string& key) {
  std::string env = "KVBRIDGE_";
  for (char c : key) {
    env.push_back(std::isalnum(static_cast<unsigned char>(c))
                      ? static_cast<char>(std::toupper(static_cast<unsigned char>(c)))
                      : '_');
  }
  return env;
}

std::optional<std::string> HostServices::Get(const std::string& key) const {
  if (auto it = config_.find(key); it != config_.end()) return it->second;
  if (const char* v = std::getenv(EnvName(key).c_str())) return std::string(v);
  return std::nullopt;
}

}  // namespace kvbridge::core
