// HostServices: the kvb_host_services_t table the core hands to each plugin instance.
// Logging goes to the one logger; config_get reads the engine's plugin_config first and then
// the mirrored KVBRIDGE_<PLUGIN>_<KEY> environment variable; now_ns is util::MonoNs.
// Thread-safe after construction (the config map is never mutated afterwards).
#pragma once

#include <map>
#include <optional>
#include <string>

#include "kvbridge/plugin/abi.h"

namespace kvbridge::core {

class HostServices {
 public:
  explicit HostServices(std::map<std::string, std::string> config);
  HostServices(const HostServices&) = delete;
  HostServices& operator=(const HostServices&) = delete;

  const kvb_host_services_t* table() const { return &table_; }
  // "tcp.lanes_per_peer" -> explicit config, else $KVBRIDGE_TCP_LANES_PER_PEER, else nullopt.
  std::optional<std::string> Get(const std::string& key) const;
  // The environment variable that mirrors a config key.
  static std::string EnvName(const std::string& key);

 private:
  std::map<std::string, std::string> config_;
  kvb_host_services_t table_;
};

}  // namespace kvbridge::core
