#include "core/plugin_host.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

namespace kvbridge::core {
namespace {

std::atomic<uint64_t> g_scans{0};

std::mutex& CacheMu() {
  static auto* mu = new std::mutex();
  return *mu;
}

// Canonical path list (as a key) -> live host. Entries of dead hosts are dropped on the next
// Acquire. Never freed: a host held by a static object may die during static destruction.
std::map<std::string, std::weak_ptr<PluginHost>>& Cache() {
  static auto* cache = new std::map<std::string, std::weak_ptr<PluginHost>>();
  return *cache;
}

std::string CanonicalDir(const std::string& dir) {
  char buf[PATH_MAX];
  return realpath(dir.c_str(), buf) != nullptr ? std::string(buf) : dir;
}

}  // namespace

std::shared_ptr<PluginHost> PluginHost::Acquire(const std::vector<std::string>& dirs) {
  std::vector<std::string> unique;
  std::vector<std::string> canonical;
  std::string key;
  for (const auto& d : dirs) {
    std::string c = CanonicalDir(d);
    if (std::find(canonical.begin(), canonical.end(), c) != canonical.end()) continue;
    canonical.push_back(c);
    unique.push_back(d);
    key += c;
    key += '\n';
  }
  std::lock_guard<std::mutex> lock(CacheMu());
  auto& cache = Cache();
  std::erase_if(cache, [](const auto& e) { return e.second.expired(); });
  if (auto it = cache.find(key); it != cache.end()) {
    if (auto host = it->second.lock()) return host;
  }
  std::shared_ptr<PluginHost> host(new PluginHost());
  host->dirs_ = unique;
  host->registry_.Scan(unique);
  g_scans.fetch_add(1);
  cache[key] = host;
  return host;
}

uint64_t PluginHost::ScanCount() { return g_scans.load(); }

PluginHost::~PluginHost() = default;

Result<std::unique_ptr<TransportInstance>> PluginHost::CreateTransport(
    const PluginInfo& plugin, const TransportConfig& config) {
  return TransportInstance::Create(shared_from_this(), plugin, config);
}

Result<std::unique_ptr<StorageInstance>> PluginHost::CreateStorage(const std::string& name,
                                                                   const StorageConfig& config) {
  std::string why;
  const PluginInfo* plugin = registry_.Find(KVB_PLUGIN_STORAGE, name, &why);
  if (plugin == nullptr) return Status::Unavailable("storage plugin '" + name + "': " + why);
  return CreateStorage(*plugin, config);
}

Result<std::unique_ptr<StorageInstance>> PluginHost::CreateStorage(const PluginInfo& plugin,
                                                                   const StorageConfig& config) {
  std::string unqualified = StorageInstance::Unqualified(plugin, config);
  if (!unqualified.empty()) {
    return Status::Unavailable("storage plugin '" + plugin.name + "': " + unqualified);
  }
  return StorageInstance::Create(shared_from_this(), plugin, config);
}

}  // namespace kvbridge::core
