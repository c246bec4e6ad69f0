// kvbridge plugin SDK, the part every plugin kind shares: sdk::Status and sdk::Result<T> (a
// kvb_status_t code with a message), sdk::Host (the kvb_host_services_t table of one instance:
// logging under the plugin's name, typed configuration, the clock, identity and the handshake
// services of ABI 1.2 through sdk::AuthSession, the device copy services through
// sdk::DevStream), and the exception barrier every trampoline runs in. transport.hpp and
// storage.hpp build the ops tables on it.
//
// Header-only C++20; it includes nothing of kvbridge but the C ABI headers, so a plugin built
// with it still sees only csrc/include/kvbridge/plugin/*.h. The C ABI stays the contract: the
// SDK only writes the glue (docs/plugin-abi.md, "The C++ SDK").
//
// Thread-safety: Status and Result are values. A Host is a cheap copy of two pointers; its
// methods may be called from any thread (the host services are thread-safe). One AuthSession or
// DevStream is used by one thread at a time, like the kvb_auth_t / kvb_dev_stream_t it owns.
#pragma once

#include <cerrno>
#include <charconv>
#include <chrono>
#include <concepts>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kvbridge/plugin/abi.h"

// Reads `field` of a struct of type T found at `src`, when the first `avail` bytes hold it whole.
#define KVB_SDK_READ_FIELD(dst, src, avail, T, field)                             \
  do {                                                                            \
    if (offsetof(T, field) + sizeof((dst).field) <= (avail)) {                    \
      std::memcpy(&(dst).field, (src) + offsetof(T, field), sizeof((dst).field)); \
    }                                                                             \
  } while (0)

namespace kvbridge::plugin::sdk {

// Byte strings the ABI hands over (keys, metadata, rkeys): borrowed for the call.
using Bytes = std::span<const uint8_t>;

inline std::string_view AsStringView(Bytes b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

// A kvb_status_t with a one-line message. Default-constructed it is OK. Converts implicitly from
// a bare code, so `return backend->Free(offset);` works where the backend speaks kvb_status_t.
class Status {
 public:
  Status() = default;
  Status(kvb_status_t code, std::string message = {})  // NOLINT(google-explicit-constructor)
      : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == KVB_OK; }
  kvb_status_t code() const { return code_; }
  const std::string& message() const { return message_; }

  // Writes the message into an ABI err buffer (always NUL-terminated, "" when there is none)
  // and returns the code.
  kvb_status_t ToAbi(char* err, uint32_t err_len) const {
    kvb_copy_message(err, err_len, message_.c_str());
    return code_;
  }

 private:
  kvb_status_t code_ = KVB_OK;
  std::string message_;
};

// A value or the Status saying why there is none. A Result built from an OK Status holds
// KVB_ERR_INTERNAL instead (a bug in the plugin: it promised a value and gave none).
template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok())
      v_ = Status(KVB_ERR_INTERNAL, "Result built from OK without a value");
  }
  // For a numeric T, a bare kvb_status_t would silently become the value: say which is meant,
  // sdk::Status(code) or T{n}.
  Result(kvb_status_t) requires(std::is_arithmetic_v<T> &&
                                !std::is_same_v<T, kvb_status_t>) = delete;

  bool ok() const { return std::holds_alternative<T>(v_); }
  // The error; an OK Status when there is a value.
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<Status, T> v_;
};

class Host;

// One run of the host's handshake (ABI 1.2 auth_* services) on a connection the transport is
// about to use; auth_end runs in the destructor. Made by Host::BeginAuth. The loop a transport
// runs over its own wire:
//   client: Step({}, &out); then while IN_PROGRESS { send out; read Need() bytes; Step(in, &out) }
//   server: read Need() bytes; Step(in, &out); send out; repeat while IN_PROGRESS
// and the connection is used only after Step returned OK (out sent first when not empty).
class AuthSession {
 public:
  struct Identity {
    std::string node_id;
    uint64_t incarnation = 0;
  };

  AuthSession(AuthSession&& o) noexcept : host_(o.host_), auth_(std::exchange(o.auth_, nullptr)) {}
  AuthSession& operator=(AuthSession&& o) noexcept {
    if (this != &o) {
      End();
      host_ = o.host_;
      auth_ = std::exchange(o.auth_, nullptr);
    }
    return *this;
  }
  AuthSession(const AuthSession&) = delete;
  AuthSession& operator=(const AuthSession&) = delete;
  ~AuthSession() { End(); }

  // How many bytes the next message has in total, given its first have.size() bytes: read up
  // to that many and ask again until the answer equals what you hold. PROTOCOL when the bytes
  // are malformed.
  Result<uint32_t> Need(Bytes have) const {
    const int32_t n =
        host_->auth_need(host_->host_ctx, auth_, have.data(), static_cast<uint32_t>(have.size()));
    if (n < 0) return Status(KVB_ERR_PROTOCOL, "malformed handshake message");
    return static_cast<uint32_t>(n);
  }

  // Feeds one whole received message (empty on a client's first call) and puts the next one to
  // send into *out (empty: nothing to send). IN_PROGRESS, OK, or the error that ended the
  // handshake, its message naming who and why (out may then hold a refusal worth sending).
  Status Step(Bytes in, std::vector<uint8_t>* out) {
    out->resize(KVB_AUTH_MAX_MESSAGE);
    uint32_t out_len = 0;
    char err[512] = "";
    const kvb_status_t st = host_->auth_step(
        host_->host_ctx, auth_, in.empty() ? nullptr : in.data(), static_cast<uint32_t>(in.size()),
        out->data(), static_cast<uint32_t>(out->size()), &out_len, err, sizeof(err));
    out->resize(out_len <= KVB_AUTH_MAX_MESSAGE ? out_len : 0);
    return Status(st, st == KVB_OK || st == KVB_IN_PROGRESS ? std::string() : std::string(err));
  }

  // After Step returned OK: who the peer proved to be.
  Result<Identity> Peer() const {
    char node[256] = "";
    Identity id;
    const kvb_status_t st =
        host_->auth_peer(host_->host_ctx, auth_, node, sizeof(node), &id.incarnation);
    if (st != KVB_OK) return Status(st, "the handshake has not authenticated a peer");
    id.node_id = node;
    return id;
  }

 private:
  friend class Host;
  AuthSession(const kvb_host_services_t* host, kvb_auth_t* auth) : host_(host), auth_(auth) {}
  void End() {
    if (auth_ != nullptr) host_->auth_end(host_->host_ctx, std::exchange(auth_, nullptr));
  }

  const kvb_host_services_t* host_;
  kvb_auth_t* auth_;
};

// One device copy queue of the host (ABI 1.2 dev_* services), destroyed with this object (which
// first waits for its queued copies). Made by Host::CreateDevStream. Move-only; one thread at a
// time, like the kvb_dev_stream_t it owns.
class DevStream {
 public:
  DevStream(DevStream&& o) noexcept : host_(o.host_), s_(std::exchange(o.s_, nullptr)) {}
  DevStream& operator=(DevStream&& o) noexcept {
    if (this != &o) {
      Destroy();
      host_ = o.host_;
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  DevStream(const DevStream&) = delete;
  DevStream& operator=(const DevStream&) = delete;
  ~DevStream() { Destroy(); }

  // Queues a copy (direction from the addresses); the ticket to ask Done/Wait about. Neither
  // buffer may be touched until one of them answered anything but IN_PROGRESS.
  Result<uint64_t> CopyAsync(void* dst, const void* src, uint64_t len) {
    uint64_t ticket = 0;
    char err[512] = "";
    const kvb_status_t st =
        host_->dev_copy_async(host_->host_ctx, s_, dst, src, len, &ticket, err, sizeof(err));
    if (st != KVB_OK) return Status(st, err);
    return ticket;
  }
  // IN_PROGRESS, OK, or the error that ended the copy (IO naming the CUDA error).
  Status Done(uint64_t ticket) {
    char err[512] = "";
    const kvb_status_t st = host_->dev_copy_done(host_->host_ctx, s_, ticket, err, sizeof(err));
    return Status(st, st == KVB_OK || st == KVB_IN_PROGRESS ? std::string() : std::string(err));
  }
  // Like Done, waiting until deadline_ns (Host::NowNs clock): DEADLINE_EXCEEDED past it.
  Status Wait(uint64_t ticket, uint64_t deadline_ns) {
    char err[512] = "";
    const kvb_status_t st =
        host_->dev_copy_wait(host_->host_ctx, s_, ticket, deadline_ns, err, sizeof(err));
    return Status(st, st == KVB_OK ? std::string() : std::string(err));
  }

 private:
  friend class Host;
  DevStream(const kvb_host_services_t* host, kvb_dev_stream_t* s) : host_(host), s_(s) {}
  void Destroy() {
    if (s_ != nullptr) host_->dev_stream_destroy(host_->host_ctx, std::exchange(s_, nullptr));
  }

  const kvb_host_services_t* host_;
  kvb_dev_stream_t* s_;
};

// The host-services table handed to one instance at create, with the plugin's name. Every
// service is checked against struct_size (KVB_HAS_FIELD) and NULL before use, so the same
// plugin runs on a host of an older minor: logging is dropped, configuration reads as unset,
// the clock falls back to std::chrono::steady_clock (CLOCK_MONOTONIC, the host's clock too), and
// the ABI 1.2 services answer KVB_ERR_UNSUPPORTED naming what is missing.
class Host {
 public:
  Host() = default;
  Host(const kvb_host_services_t* table, const char* plugin_name)
      : table_(table), plugin_(plugin_name) {}

  // For a backend that takes the table itself. NULL when the host passed none.
  const kvb_host_services_t* raw() const { return table_; }
  const char* plugin_name() const { return plugin_; }

  // One log line, printf-style, under the plugin's name.
  void Log(int32_t level, const char* fmt, ...) const __attribute__((format(printf, 3, 4))) {
    if (!Has(&kvb_host_services_t::log, offsetof(kvb_host_services_t, log))) return;
    va_list ap;
    va_start(ap, fmt);
    const std::string msg = VFormat(fmt, ap);
    va_end(ap);
    table_->log(table_->host_ctx, level, plugin_, msg.c_str());
  }

  uint64_t NowNs() const {
    if (Has(&kvb_host_services_t::now_ns, offsetof(kvb_host_services_t, now_ns))) {
      return table_->now_ns(table_->host_ctx);
    }
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  }

  // The raw value of a configuration key ("tcp.lanes_per_peer"), or nullopt when unset.
  Result<std::optional<std::string>> ConfigString(std::string_view key) const {
    if (!Has(&kvb_host_services_t::config_get, offsetof(kvb_host_services_t, config_get))) {
      return std::optional<std::string>();
    }
    const std::string k(key);
    std::string buf(128, '\0');
    for (;;) {
      const int32_t n = table_->config_get(table_->host_ctx, k.c_str(), buf.data(),
                                           static_cast<uint32_t>(buf.size()));
      if (n == -1) return std::optional<std::string>();
      if (n >= 0) {
        buf.resize(static_cast<size_t>(n));
        return std::optional<std::string>(std::move(buf));
      }
      if (n != -2 || buf.size() >= kMaxConfigValue) {
        return Status(KVB_ERR_INVALID_ARGUMENT, Prefix() + k +
                                                    ": the host could not hand over "
                                                    "its value (longer than " +
                                                    std::to_string(kMaxConfigValue) + " bytes?)");
      }
      buf.assign(buf.size() * 4, '\0');
    }
  }

  // A numeric key: unset gives `def`; a value that does not parse as a whole, or lies outside
  // [min, max], is INVALID_ARGUMENT with a message naming the key, the value and the rule.
  template <typename T>
  requires(std::is_arithmetic_v<T> &&
           !std::is_same_v<T, bool>) Result<T> Config(std::string_view key, T def,
                                                      T min = std::numeric_limits<T>::lowest(),
                                                      T max = std::numeric_limits<T>::max())
  const {
    auto raw = ConfigString(key);
    if (!raw.ok()) return raw.status();
    if (!raw->has_value()) return def;
    const std::string& v = **raw;
    T out{};
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
      const char* what = std::is_floating_point_v<T> ? "a number"
                         : std::is_signed_v<T>       ? "an integer"
                                                     : "an unsigned integer";
      return Bad(key, v,
                 std::string("is not ") + what +
                     (ec == std::errc::result_out_of_range ? " that fits" : ""));
    }
    if (out < min || out > max) {
      return Bad(key, v, "is out of range [" + Num(min) + ", " + Num(max) + "]");
    }
    return out;
  }

  // A boolean key (1/0, true/false, on/off, yes/no) or a string key; unset gives `def`.
  template <typename T>
  requires(std::is_same_v<T, bool> ||
           std::is_same_v<T, std::string>) Result<T> Config(std::string_view key, T def)
  const {
    auto raw = ConfigString(key);
    if (!raw.ok()) return raw.status();
    if (!raw->has_value()) return def;
    if constexpr (std::is_same_v<T, std::string>) {
      return std::move(**raw);
    } else {
      const std::string& v = **raw;
      if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
      if (v == "0" || v == "false" || v == "off" || v == "no") return false;
      return Bad(key, v, "is not a boolean (1/0, true/false, on/off, yes/no)");
    }
  }

  // ---- ABI 1.2: identity and the handshake ------------------------------------------------

  // This process's node id and incarnation; UNSUPPORTED on a host older than 1.2.
  Result<std::string> NodeId() const {
    if (!Has(&kvb_host_services_t::node_id, offsetof(kvb_host_services_t, node_id))) {
      return Missing("node_id");
    }
    const char* id = table_->node_id(table_->host_ctx);
    return std::string(id != nullptr ? id : "");
  }
  Result<uint64_t> Incarnation() const {
    if (!Has(&kvb_host_services_t::incarnation, offsetof(kvb_host_services_t, incarnation))) {
      return Missing("incarnation");
    }
    return table_->incarnation(table_->host_ctx);
  }

  // Starts one handshake (role KVB_AUTH_CLIENT or KVB_AUTH_SERVER), labelled with the plugin's
  // name. A client names the incarnation it means to reach; a server passes "" and 0.
  // UNSUPPORTED on a host older than 1.2 (or one that leaves any auth_* service NULL).
  Result<AuthSession> BeginAuth(int32_t role, std::string_view expected_node_id = {},
                                uint64_t expected_incarnation = 0) const {
    const bool all =
        Has(&kvb_host_services_t::auth_begin, offsetof(kvb_host_services_t, auth_begin)) &&
        Has(&kvb_host_services_t::auth_need, offsetof(kvb_host_services_t, auth_need)) &&
        Has(&kvb_host_services_t::auth_step, offsetof(kvb_host_services_t, auth_step)) &&
        Has(&kvb_host_services_t::auth_peer, offsetof(kvb_host_services_t, auth_peer)) &&
        Has(&kvb_host_services_t::auth_end, offsetof(kvb_host_services_t, auth_end));
    if (!all) return Missing("auth_begin ... auth_end");
    const std::string expected(expected_node_id);
    kvb_auth_t* a = nullptr;
    char err[512] = "";
    const kvb_status_t st = table_->auth_begin(table_->host_ctx, plugin_, role,
                                               role == KVB_AUTH_CLIENT ? expected.c_str() : nullptr,
                                               expected_incarnation, &a, err, sizeof(err));
    if (st != KVB_OK) return Status(st, err);
    if (a == nullptr) return Status(KVB_ERR_INTERNAL, Prefix() + "auth_begin returned no state");
    return AuthSession(table_, a);
  }

  // ---- ABI 1.2: device memory ---------------------------------------------------------------

  // Whether the host offers every device service (ABI 1.2 dev_* and pinned_*). They may still
  // answer UNAVAILABLE: a host without a CUDA driver offers them and refuses every call.
  bool HasDeviceServices() const {
    return HasStreamServices() &&
           Has(&kvb_host_services_t::pinned_alloc, offsetof(kvb_host_services_t, pinned_alloc)) &&
           Has(&kvb_host_services_t::pinned_free, offsetof(kvb_host_services_t, pinned_free));
  }

  // A copy queue on CUDA device `device_id`. UNSUPPORTED on a host older than 1.2 (or one that
  // leaves a dev_* service NULL); UNAVAILABLE, naming libcuda, on a host without a CUDA driver.
  Result<DevStream> CreateDevStream(int32_t device_id) const {
    if (!HasStreamServices()) return Missing("dev_stream_create ... dev_copy_wait");
    kvb_dev_stream_t* s = nullptr;
    char err[512] = "";
    const kvb_status_t st =
        table_->dev_stream_create(table_->host_ctx, device_id, &s, err, sizeof(err));
    if (st != KVB_OK) return Status(st, Prefix() + err);
    if (s == nullptr) return Status(KVB_ERR_INTERNAL, Prefix() + "dev_stream_create returned none");
    return DevStream(table_, s);
  }

  // Page-locked host memory, freed with PinnedFree. UNSUPPORTED before 1.2, UNAVAILABLE without
  // a CUDA driver, NO_SPACE when the driver refuses.
  Result<void*> PinnedAlloc(uint64_t len) const {
    if (!Has(&kvb_host_services_t::pinned_alloc, offsetof(kvb_host_services_t, pinned_alloc)) ||
        !Has(&kvb_host_services_t::pinned_free, offsetof(kvb_host_services_t, pinned_free))) {
      return Missing("pinned_alloc");
    }
    void* p = nullptr;
    const kvb_status_t st = table_->pinned_alloc(table_->host_ctx, len, &p);
    if (st != KVB_OK) {
      return Status(st, Prefix() + "pinned_alloc of " + std::to_string(len) + " bytes failed");
    }
    return p;
  }
  void PinnedFree(void* p) const {
    if (p != nullptr &&
        Has(&kvb_host_services_t::pinned_free, offsetof(kvb_host_services_t, pinned_free))) {
      table_->pinned_free(table_->host_ctx, p);
    }
  }

 private:
  static constexpr size_t kMaxConfigValue = 64 * 1024;

  // True when the table is long enough to hold the field starting at `offset` and it is set.
  template <typename F>
  bool Has(F kvb_host_services_t::*field, size_t offset) const {
    return table_ != nullptr && table_->struct_size >= offset + sizeof(F) &&
           table_->*field != nullptr;
  }

  // dev_stream_create ... dev_copy_wait, all offered.
  bool HasStreamServices() const {
    return Has(&kvb_host_services_t::dev_stream_create,
               offsetof(kvb_host_services_t, dev_stream_create)) &&
           Has(&kvb_host_services_t::dev_stream_destroy,
               offsetof(kvb_host_services_t, dev_stream_destroy)) &&
           Has(&kvb_host_services_t::dev_copy_async,
               offsetof(kvb_host_services_t, dev_copy_async)) &&
           Has(&kvb_host_services_t::dev_copy_done, offsetof(kvb_host_services_t, dev_copy_done)) &&
           Has(&kvb_host_services_t::dev_copy_wait, offsetof(kvb_host_services_t, dev_copy_wait));
  }

  std::string Prefix() const { return std::string(plugin_) + ": "; }

  Status Missing(const char* what) const {
    return Status(KVB_ERR_UNSUPPORTED, Prefix() + "the host offers no '" + what +
                                           "' service (a host older than ABI 1.2 has none)");
  }

  Status Bad(std::string_view key, const std::string& value, const std::string& rule) const {
    return Status(KVB_ERR_INVALID_ARGUMENT,
                  Prefix() + std::string(key) + ": '" + value + "' " + rule);
  }

  template <typename T>
  static std::string Num(T v) {
    if constexpr (std::is_floating_point_v<T>) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
      return buf;
    } else {
      return std::to_string(v);
    }
  }

  static std::string VFormat(const char* fmt, va_list ap) {
    va_list copy;
    va_copy(copy, ap);
    const int n = std::vsnprintf(nullptr, 0, fmt, copy);
    va_end(copy);
    if (n <= 0) return std::string();
    std::string out(static_cast<size_t>(n) + 1, '\0');
    std::vsnprintf(out.data(), out.size(), fmt, ap);
    out.resize(static_cast<size_t>(n));
    return out;
  }

  const kvb_host_services_t* table_ = nullptr;
  const char* plugin_ = "";
};

namespace detail {

// True when `s` is a valid plugin name: 1-64 characters of [a-z0-9_] (the loader's rule,
// checked at compile time here so a bad kName is a build error).
constexpr bool ValidPluginName(const char* s) {
  if (s == nullptr || s[0] == '\0') return false;
  size_t n = 0;
  for (; s[n] != '\0'; ++n) {
    const char c = s[n];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_') || n >= 64) return false;
  }
  return true;
}

template <typename P>
constexpr uint16_t MinHostMinor() {
  if constexpr (requires { P::kMinHostMinor; }) {
    return static_cast<uint16_t>(P::kMinHostMinor);
  } else {
    return 0;
  }
}

// The body of kvb_plugin_query: the descriptor for this major and a host minor the class can
// live with (Class::kMinHostMinor, 0 when absent), else NULL.
template <typename P>
const kvb_plugin_descriptor_t* Query(const kvb_plugin_descriptor_t* desc, uint16_t host_major,
                                     uint16_t host_minor) noexcept {
  if (host_major != KVB_ABI_MAJOR || host_minor < MinHostMinor<P>()) return nullptr;
  return desc;
}

// The exception barrier of every trampoline: runs fn (returning kvb_status_t); an escaping
// exception becomes KVB_ERR_INTERNAL with "<plugin>: internal error in <op>: <what>", written
// into err when the op has one, and logged through the host in every case.
template <typename Fn>
kvb_status_t Guard(const Host& host, const char* op, char* err, uint32_t err_len,
                   Fn&& fn) noexcept {
  std::string what;
  try {
    return fn();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "an exception that is not a std::exception";
  }
  try {
    const std::string msg = std::string("internal error in ") + op + ": " + what;
    kvb_copy_message(err, err_len, (std::string(host.plugin_name()) + ": " + msg).c_str());
    host.Log(KVB_LOG_ERROR, "%s", msg.c_str());  // the host prefixes the plugin's name
  } catch (...) {
    kvb_copy_message(err, err_len, "internal error (out of memory while reporting it)");
  }
  return KVB_ERR_INTERNAL;
}

// Copies what fits of a versioned output struct (usage, stats) into the host's, whose
// struct_size says how much it has room for; the host's struct_size is kept.
template <typename S>
kvb_status_t CopyVersioned(S* dst, const S& src) {
  if (dst == nullptr || dst->struct_size < sizeof(uint32_t)) return KVB_ERR_INVALID_ARGUMENT;
  const uint32_t size = dst->struct_size;
  const size_t n = size < sizeof(S) ? size : sizeof(S);
  std::memcpy(reinterpret_cast<uint8_t*>(dst) + sizeof(uint32_t),
              reinterpret_cast<const uint8_t*>(&src) + sizeof(uint32_t), n - sizeof(uint32_t));
  return KVB_OK;
}

// A plugin's static Probe() (OK when the class has none), its message into `reason`.
template <typename P>
kvb_status_t Probe(char* reason, uint32_t reason_len) noexcept {
  if constexpr (requires {
                  { P::Probe() } -> std::convertible_to<Status>;
                }) {
    try {
      return Status(P::Probe()).ToAbi(reason, reason_len);
    } catch (const std::exception& e) {
      kvb_copy_message(reason, reason_len, e.what());
      return KVB_ERR_INTERNAL;
    } catch (...) {
      kvb_copy_message(reason, reason_len, "probe threw");
      return KVB_ERR_INTERNAL;
    }
  } else {
    kvb_copy_message(reason, reason_len, "");
    return KVB_OK;
  }
}

// The descriptor of class P: its name, version and the kind's caps and ops table.
template <typename P>
constexpr kvb_plugin_descriptor_t Descriptor(int32_t kind, uint64_t caps, const void* ops) {
  return kvb_plugin_descriptor_t{
      .struct_size = sizeof(kvb_plugin_descriptor_t),
      .abi_major = KVB_ABI_MAJOR,
      .abi_minor = KVB_ABI_MINOR,
      .name = P::kName,
      .version = P::kVersion,
      .kind = kind,
      .reserved = 0,
      .caps = caps,
      .probe = Probe<P>,
      .ops = ops,
  };
}

// An ops-table slot: the real trampoline `real` when `cond` holds, else the ABI's `stub`. (A
// macro, since the real one may be named only where it compiles: inside the if constexpr.)
#define KVB_SDK_SLOT(cond, real, stub) \
  [] {                                 \
    if constexpr (cond) {              \
      return &real;                    \
    } else {                           \
      return &stub;                    \
    }                                  \
  }()

// The exported kvb_plugin_query of KVB_TRANSPORT_PLUGIN / KVB_STORAGE_PLUGIN, answered by
// sdk::<query><Class>.
#define KVB_SDK_EXPORT_QUERY(query, Class)                                        \
  extern "C" KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(   \
      uint16_t host_abi_major, uint16_t host_abi_minor) {                         \
    return ::kvbridge::plugin::sdk::query<Class>(host_abi_major, host_abi_minor); \
  }

// What the handle the host holds points at: the plugin object and its Host.
template <typename P>
struct Instance {
  Host host;
  std::unique_ptr<P> impl;
};

// For ops without an err buffer: a failure's message goes to the log at debug level; returns
// the code.
inline kvb_status_t Logged(const Host& host, const char* op, const Status& st) {
  if (!st.ok() && !st.message().empty()) {
    host.Log(KVB_LOG_DEBUG, "%s: %s", op, st.message().c_str());
  }
  return st.code();
}

// "<plugin>: <op>: <what> is NULL", INVALID_ARGUMENT.
inline Status NullArgument(const char* plugin, const char* op, const char* what) {
  return Status(KVB_ERR_INVALID_ARGUMENT,
                std::string(plugin) + ": " + op + ": " + what + " is NULL");
}

// The create op of either kind: make(host) runs the class's Create; on success the host's
// handle (Handle*: kvb_transport_t or kvb_storage_t) points at a new Instance<P>.
template <typename P, typename Handle, typename Make>
kvb_status_t CreateInstance(const kvb_host_services_t* services, bool params_ok, Handle** out,
                            char* err, uint32_t err_len, Make&& make) {
  Host host(services, P::kName);
  return Guard(host, "create", err, err_len, [&]() -> kvb_status_t {
    if (!params_ok || out == nullptr) {
      return NullArgument(P::kName, "create", "params or out").ToAbi(err, err_len);
    }
    Result<std::unique_ptr<P>> made = make(host);
    if (!made.ok()) return made.status().ToAbi(err, err_len);
    if (*made == nullptr) {
      return Status(KVB_ERR_INTERNAL, std::string(P::kName) + ": Create returned no instance")
          .ToAbi(err, err_len);
    }
    auto inst = std::make_unique<Instance<P>>(Instance<P>{host, std::move(*made)});
    *out = reinterpret_cast<Handle*>(inst.release());
    kvb_copy_message(err, err_len, "");
    return KVB_OK;
  });
}

// The destroy op of either kind: deletes the Instance<P> (and so the class instance).
template <typename P, typename Handle>
void DestroyInstance(Handle* h) {
  if (h == nullptr) return;
  auto* inst = reinterpret_cast<Instance<P>*>(h);
  const Host host = inst->host;
  Guard(host, "destroy", nullptr, 0, [&] {
    delete inst;
    return KVB_OK;
  });
}

// Checks shared by both kinds, as compile errors that name what is missing.
template <typename P>
constexpr bool CheckIdentity() {
  static_assert(
      requires {
        { P::kName } -> std::convertible_to<const char*>;
      },
      "a plugin class needs `static constexpr const char* kName`");
  static_assert(
      requires {
        { P::kVersion } -> std::convertible_to<const char*>;
      },
      "a plugin class needs `static constexpr const char* kVersion`");
  static_assert(ValidPluginName(P::kName), "kName must be 1-64 characters of [a-z0-9_]");
  return true;
}

}  // namespace detail
}  // namespace kvbridge::plugin::sdk
