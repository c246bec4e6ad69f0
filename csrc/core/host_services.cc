#include "core/host_services.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/cuda_driver.h"
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
    kvb_copy_message(err, err_len,
                     "auth_begin: this host has no identity (only a transfer engine's "
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
    kvb_copy_message(err, err_len,
                     "auth_begin: a client must name the peer's node id (1..255 bytes)");
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

// ---- ABI 1.2: device memory, on core/cuda_driver ------------------------------------------

}  // namespace
}  // namespace kvbridge::core

// One device copy queue: a CUstream on the device's primary context (retained while the stream
// lives) and one CUevent per ticket not yet answered. The mutex guards the ticket map.
struct kvb_dev_stream {
  const kvbridge::core::cuda::Driver* d = nullptr;
  int device = 0;
  std::unique_ptr<kvbridge::core::cuda::DeviceStream> stream;  // retains the primary context
  std::mutex mu;
  uint64_t next_ticket = 1;
  std::unordered_map<uint64_t, kvbridge::core::cuda::CUevent> tickets;
};

namespace kvbridge::core {
namespace {

// The driver, or KVB_ERR_UNAVAILABLE with err naming the library and the service.
const cuda::Driver* DriverFor(const char* service, char* err, uint32_t err_len) {
  Result<const cuda::Driver*> d = cuda::GetDriver();
  if (d.ok()) return d.value();
  kvb_copy_message(err, err_len, (std::string(service) + ": " + d.status().message()).c_str());
  return nullptr;
}

kvb_status_t Fail(const Status& st, char* err, uint32_t err_len) {
  kvb_copy_message(err, err_len, st.message().c_str());
  return static_cast<kvb_status_t>(st.code());
}

kvb_status_t HostDevStreamCreate(void*, int32_t device_id, kvb_dev_stream_t** out, char* err,
                                 uint32_t err_len) {
  const cuda::Driver* d = DriverFor("dev_stream_create", err, err_len);
  if (d == nullptr) return KVB_ERR_UNAVAILABLE;
  if (out == nullptr || device_id < 0) {
    kvb_copy_message(err, err_len, "dev_stream_create: needs a device id >= 0 and an out pointer");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  Result<std::unique_ptr<cuda::DeviceStream>> stream =
      cuda::DeviceStream::Create(*d, device_id, "dev_stream_create");
  if (!stream.ok()) return Fail(stream.status(), err, err_len);
  auto s = std::make_unique<kvb_dev_stream_t>();
  s->d = d;
  s->device = device_id;
  s->stream = std::move(stream).value();
  *out = s.release();
  return KVB_OK;
}

void HostDevStreamDestroy(void*, kvb_dev_stream_t* s) {
  if (s == nullptr) return;
  const cuda::Driver& d = *s->d;
  {
    cuda::ScopedDeviceContext ctx(d, s->device);
    std::lock_guard<std::mutex> lock(s->mu);
    for (auto& [ticket, ev] : s->tickets) {
      (void)d.cuEventSynchronize(ev);
      (void)d.cuEventDestroy(ev);
    }
    s->tickets.clear();
  }
  delete s;  // the stream: destroyed, then its primary context released
}

kvb_status_t HostDevCopyAsync(void*, kvb_dev_stream_t* s, void* dst, const void* src, uint64_t len,
                              uint64_t* ticket, char* err, uint32_t err_len) {
  const cuda::Driver* d = DriverFor("dev_copy_async", err, err_len);
  if (d == nullptr) return KVB_ERR_UNAVAILABLE;
  if (s == nullptr || dst == nullptr || src == nullptr || len == 0 || ticket == nullptr) {
    kvb_copy_message(err, err_len,
                     "dev_copy_async: needs a stream, non-NULL dst and src, len > 0 and a ticket "
                     "pointer");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  cuda::ScopedDeviceContext ctx(*d, s->device);
  if (!ctx.status().ok()) return Fail(ctx.status().WithContext("dev_copy_async"), err, err_len);
  cuda::CUevent ev = nullptr;
  Status st =
      d->Check(d->cuEventCreate(&ev, cuda::kEventDisableTiming), "dev_copy_async: cuEventCreate");
  if (st.ok()) {
    st = d->Check(d->cuMemcpyAsync(reinterpret_cast<cuda::CUdeviceptr>(dst),
                                   reinterpret_cast<cuda::CUdeviceptr>(src), len, s->stream->get()),
                  "dev_copy_async: cuMemcpyAsync of " + std::to_string(len) + " bytes");
  }
  if (st.ok())
    st = d->Check(d->cuEventRecord(ev, s->stream->get()), "dev_copy_async: cuEventRecord");
  if (!st.ok()) {
    if (ev != nullptr) (void)d->cuEventDestroy(ev);
    return Fail(st, err, err_len);
  }
  std::lock_guard<std::mutex> lock(s->mu);
  *ticket = s->next_ticket++;
  s->tickets.emplace(*ticket, ev);
  return KVB_OK;
}

// One look at a ticket's event: IN_PROGRESS, or the final answer (the ticket is then retired).
kvb_status_t QueryTicket(kvb_dev_stream_t* s, uint64_t ticket, const char* service, char* err,
                         uint32_t err_len) {
  const cuda::Driver& d = *s->d;
  std::lock_guard<std::mutex> lock(s->mu);
  auto it = s->tickets.find(ticket);
  if (it == s->tickets.end()) {
    kvb_copy_message(err, err_len,
                     (std::string(service) + ": ticket " + std::to_string(ticket) +
                      " is not pending on this stream")
                         .c_str());
    return KVB_ERR_NOT_FOUND;
  }
  const cuda::CUresult r = d.cuEventQuery(it->second);
  if (r == cuda::kErrorNotReady) return KVB_IN_PROGRESS;
  (void)d.cuEventDestroy(it->second);
  s->tickets.erase(it);
  if (r == cuda::kSuccess) return KVB_OK;
  return Fail(d.Check(r, std::string(service) + ": copy (ticket " + std::to_string(ticket) +
                             ") on device " + std::to_string(s->device) + " failed"),
              err, err_len);
}

kvb_status_t HostDevCopyDone(void*, kvb_dev_stream_t* s, uint64_t ticket, char* err,
                             uint32_t err_len) {
  if (DriverFor("dev_copy_done", err, err_len) == nullptr) return KVB_ERR_UNAVAILABLE;
  if (s == nullptr) {
    kvb_copy_message(err, err_len, "dev_copy_done: no stream");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  return QueryTicket(s, ticket, "dev_copy_done", err, err_len);
}

kvb_status_t HostDevCopyWait(void*, kvb_dev_stream_t* s, uint64_t ticket, uint64_t deadline_ns,
                             char* err, uint32_t err_len) {
  if (DriverFor("dev_copy_wait", err, err_len) == nullptr) return KVB_ERR_UNAVAILABLE;
  if (s == nullptr) {
    kvb_copy_message(err, err_len, "dev_copy_wait: no stream");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  // Polls the event (cuEventSynchronize has no deadline), backing off from 10 us to 1 ms.
  std::chrono::microseconds nap(10);
  for (;;) {
    const kvb_status_t st = QueryTicket(s, ticket, "dev_copy_wait", err, err_len);
    if (st != KVB_IN_PROGRESS) return st;
    const uint64_t now = util::MonoNs();
    if (now >= deadline_ns) {
      kvb_copy_message(err, err_len,
                       ("dev_copy_wait: copy (ticket " + std::to_string(ticket) + ") on device " +
                        std::to_string(s->device) + " not done by its deadline; it may still run")
                           .c_str());
      return KVB_ERR_DEADLINE_EXCEEDED;
    }
    const auto left = std::chrono::nanoseconds(deadline_ns - now);
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(nap, left));
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
}

kvb_status_t HostPinnedAlloc(void*, uint64_t len, void** out) {
  if (out == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  *out = nullptr;
  Result<const cuda::Driver*> d = cuda::GetDriver();
  if (!d.ok()) return KVB_ERR_UNAVAILABLE;
  if (len == 0) return KVB_ERR_INVALID_ARGUMENT;
  cuda::ScopedDeviceContext ctx(*d.value(), 0);
  if (!ctx.status().ok()) return KVB_ERR_IO;
  const cuda::CUresult r = d.value()->cuMemHostAlloc(out, len, cuda::kMemHostAllocPortable);
  if (r == cuda::kSuccess) return KVB_OK;
  *out = nullptr;
  return KVB_ERR_NO_SPACE;
}

void HostPinnedFree(void*, void* p) {
  if (p == nullptr) return;
  Result<const cuda::Driver*> d = cuda::GetDriver();
  if (!d.ok()) return;
  cuda::ScopedDeviceContext ctx(*d.value(), 0);
  (void)d.value()->cuMemFreeHost(p);
}

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
      .dev_stream_create = HostDevStreamCreate,
      .dev_stream_destroy = HostDevStreamDestroy,
      .dev_copy_async = HostDevCopyAsync,
      .dev_copy_done = HostDevCopyDone,
      .dev_copy_wait = HostDevCopyWait,
      .pinned_alloc = HostPinnedAlloc,
      .pinned_free = HostPinnedFree,
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
