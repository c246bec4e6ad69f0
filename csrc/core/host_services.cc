#include "core/host_services.h"

#include <cctype>
#include <cstdlib>
#include <cstring>

#include "util/clock.h"
#include "util/logging.h"

namespace kvbridge::core {
namespace {

void HostLog(void* ctx, int32_t level, const char* plugin, const char* msg) {
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

}  // namespace

HostServices::HostServices(std::map<std::string, std::string> config) : config_(std::move(config)) {
  table_ = kvb_host_services_t{
      .struct_size = sizeof(kvb_host_services_t),
      .host_ctx = this,
      .log = HostLog,
      .config_get = HostConfigGet,
      .now_ns = HostNowNs,
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
