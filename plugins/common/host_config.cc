#include "host_config.h"

#include <charconv>

namespace kvbridge::plugin {

bool HostHas(const kvb_host_services_t* host, size_t end) {
  return host != nullptr && host->struct_size >= end;
}

void HostLog(const kvb_host_services_t* host, int32_t level, const char* plugin,
             const std::string& msg) {
  if (HostHas(host, offsetof(kvb_host_services_t, log) + sizeof(host->log)) &&
      host->log != nullptr) {
    host->log(host->host_ctx, level, plugin, msg.c_str());
  }
}

bool ReadConfigKey(const kvb_host_services_t* host, const char* plugin, const char* key,
                   std::string* value, bool* set, std::string* err) {
  *set = false;
  if (!HostHas(host, offsetof(kvb_host_services_t, config_get) + sizeof(host->config_get)) ||
      host->config_get == nullptr) {
    return true;
  }
  char buf[64];
  const int32_t n = host->config_get(host->host_ctx, key, buf, sizeof(buf));
  if (n == -1) return true;
  if (n < 0) {
    *err = std::string(plugin) + ": " + key + ": value is too long";
    return false;
  }
  value->assign(buf, static_cast<size_t>(n));
  *set = true;
  return true;
}

bool ParseUnsigned(const std::string& s, uint64_t* out) {
  if (s.empty()) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

}  // namespace kvbridge::plugin
