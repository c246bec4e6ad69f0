// HostServices: the kvb_host_services_t table the core hands to each plugin instance.
// Logging goes to the one logger (or a sink given at construction); config_get reads the
// engine's plugin_config first and then the mirrored KVBRIDGE_<PLUGIN>_<KEY> environment
// variable; now_ns is util::MonoNs. ABI 1.2: node_id/incarnation and the peer handshake
// (auth_*) come from the Identity given at construction (core/peer_auth.h); a table made
// without an identity (storage plugins) answers the auth services UNAVAILABLE. The device
// services (dev_*, pinned_*) run on the CUDA driver loaded at first use (core/cuda_driver.h):
// one CUstream per kvb_dev_stream_t, one CUevent per copy ticket; UNAVAILABLE without a driver.
// Thread-safe after construction (nothing is mutated afterwards).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>

#include "core/peer_auth.h"
#include "kvbridge/plugin/abi.h"

namespace kvbridge::core {

class HostServices {
 public:
  // Receives each plugin log line instead of the logger (tests capture them).
  using LogSink = std::function<void(int32_t level, const char* plugin, const char* msg)>;

  explicit HostServices(std::map<std::string, std::string> config,
                        std::optional<auth::Identity> identity = std::nullopt,
                        LogSink sink = nullptr);
  HostServices(const HostServices&) = delete;
  HostServices& operator=(const HostServices&) = delete;

  const kvb_host_services_t* table() const { return &table_; }
  // "tcp.lanes_per_peer" -> explicit config, else $KVBRIDGE_TCP_LANES_PER_PEER, else nullopt.
  std::optional<std::string> Get(const std::string& key) const;
  // The environment variable that mirrors a config key.
  static std::string EnvName(const std::string& key);

  const std::optional<auth::Identity>& identity() const { return identity_; }
  const LogSink& sink() const { return sink_; }

 private:
  std::map<std::string, std::string> config_;
  std::optional<auth::Identity> identity_;
  LogSink sink_;
  kvb_host_services_t table_;
};

}  // namespace kvbridge::core
