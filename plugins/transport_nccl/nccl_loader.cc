#include "nccl_loader.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <mutex>
#include <system_error>
#include <utility>

namespace kvbridge::nccl {
namespace {

constexpr const char* kWheelRelative = "nvidia/nccl/lib/libnccl.so.2";
constexpr const char* kDefaultCudaDriver = "libcuda.so.1";

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

bool IsFile(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec);  // follows symlinks
}

std::string DlError(const char* fallback) {
  const char* why = dlerror();
  return why != nullptr ? why : fallback;
}

// The file the dynamic linker mapped for `handle`, "" when it does not say.
std::string MappedFile(void* handle) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || map == nullptr || map->l_name == nullptr) {
    return "";
  }
  return map->l_name;
}

template <typename Fn>
bool Get(const std::function<void*(const char*)>& lookup, const char* name, Fn* out,
         std::string* missing) {
  void* p = lookup(name);
  *out = reinterpret_cast<Fn>(p);
  if (p == nullptr && missing->empty()) *missing = name;
  return p != nullptr;
}

std::string NcclName(const Nccl& n) { return "NCCL " + n.version() + " from " + n.path; }

std::string CudaErrorName(const detail::CudaProbe& cuda, int r) {
  const char* name = nullptr;
  if (cuda.cuGetErrorName != nullptr && cuda.cuGetErrorName(r, &name) == 0 && name != nullptr) {
    return std::string(name) + " (" + std::to_string(r) + ")";
  }
  return "CUDA error " + std::to_string(r);
}

}  // namespace

std::string FormatNcclVersion(int code) {
  int major = 0, minor = 0, patch = 0;
  if (code >= 10000) {  // NCCL >= 2.9
    major = code / 10000;
    minor = code % 10000 / 100;
  } else {
    major = code / 1000;
    minor = code % 1000 / 100;
  }
  patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

ncclConfig_t MakeNcclConfig(int blocking) {
  ncclConfig_t c{};
  c.size = kNcclConfigBytes;
  c.magic = kNcclConfigMagic;
  c.version = kNcclConfigVersion;  // the fields above are NCCL 2.18's; see nccl_loader.h
  c.blocking = blocking;
  c.cgaClusterSize = std::numeric_limits<int>::min();  // NCCL_CONFIG_UNDEF_INT
  c.minCTAs = std::numeric_limits<int>::min();
  c.maxCTAs = std::numeric_limits<int>::min();
  c.netName = nullptr;  // NCCL_CONFIG_UNDEF_PTR
  c.splitShare = std::numeric_limits<int>::min();
  return c;
}

std::string Nccl::ErrorString(ncclResult_t r) const {
  const char* s = ncclGetErrorString != nullptr ? ncclGetErrorString(r) : nullptr;
  if (s != nullptr && s[0] != '\0') return std::string(s) + " (" + std::to_string(r) + ")";
  return "NCCL error " + std::to_string(r);
}

namespace detail {

sdk::Result<std::unique_ptr<Nccl>> Bind(const std::function<void*(const char*)>& lookup) {
  auto n = std::make_unique<Nccl>();
  std::string missing;
  Get(lookup, "ncclGetVersion", &n->ncclGetVersion, &missing);
  Get(lookup, "ncclGetUniqueId", &n->ncclGetUniqueId, &missing);
  Get(lookup, "ncclCommInitRank", &n->ncclCommInitRank, &missing);
  Get(lookup, "ncclCommAbort", &n->ncclCommAbort, &missing);
  Get(lookup, "ncclCommDestroy", &n->ncclCommDestroy, &missing);
  Get(lookup, "ncclCommGetAsyncError", &n->ncclCommGetAsyncError, &missing);
  Get(lookup, "ncclSend", &n->ncclSend, &missing);
  Get(lookup, "ncclRecv", &n->ncclRecv, &missing);
  Get(lookup, "ncclGroupStart", &n->ncclGroupStart, &missing);
  Get(lookup, "ncclGroupEnd", &n->ncclGroupEnd, &missing);
  Get(lookup, "ncclGetErrorString", &n->ncclGetErrorString, &missing);
  if (!missing.empty()) return sdk::Status(KVB_ERR_UNAVAILABLE, "lacks " + missing);
  n->ncclCommInitRankConfig =
      reinterpret_cast<decltype(n->ncclCommInitRankConfig)>(lookup("ncclCommInitRankConfig"));

  int code = 0;
  if (const ncclResult_t r = n->ncclGetVersion(&code); r != ncclSuccess) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, "ncclGetVersion failed: " + n->ErrorString(r));
  }
  n->version_code = code;
  if (code < kMinNcclVersionCode) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, "NCCL " + FormatNcclVersion(code) + " is older than " +
                                                FormatNcclVersion(kMinNcclVersionCode) +
                                                ", the oldest kvbridge supports");
  }
  n->major = code / 10000;
  n->minor = code % 10000 / 100;
  n->patch = code % 100;
  return n;
}

sdk::Status ProbeWith(const Nccl& nccl, const CudaProbe& cuda) {
  const std::string prefix = NcclName(nccl) + " is loaded but ";
  if (cuda.cuInit == nullptr || cuda.cuDeviceGetCount == nullptr) {
    return sdk::Status(KVB_ERR_UNAVAILABLE,
                       prefix + "the CUDA driver " + cuda.path + " lacks " +
                           (cuda.cuInit == nullptr ? "cuInit" : "cuDeviceGetCount"));
  }
  if (const int r = cuda.cuInit(0); r != 0) {
    return sdk::Status(KVB_ERR_UNAVAILABLE,
                       prefix + "the CUDA driver " + cuda.path +
                           " cannot start: cuInit(0) failed: " + CudaErrorName(cuda, r));
  }
  int count = 0;
  if (const int r = cuda.cuDeviceGetCount(&count); r != 0) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, prefix + "the CUDA driver " + cuda.path +
                                                " cannot count GPUs: cuDeviceGetCount failed: " +
                                                CudaErrorName(cuda, r));
  }
  if (count <= 0) {
    return sdk::Status(KVB_ERR_UNAVAILABLE,
                       prefix + "the CUDA driver " + cuda.path +
                           " sees no GPU (cuDeviceGetCount: " + std::to_string(count) + ")");
  }
  return sdk::Status();
}

}  // namespace detail

namespace {

// Every table LoadNccl handed out, with its library. The list is a plain pointer, not an object
// with a destructor, so the tables stay valid however static destructors are ordered; only
// ReleaseUnusedTables frees it.
struct Loaded {
  std::unique_ptr<Nccl> table;
  void* lib = nullptr;
};
std::mutex g_loaded_mu;
std::vector<Loaded>* g_loaded = nullptr;  // guarded by g_loaded_mu
std::vector<Loaded>& LoadedTables() {
  if (g_loaded == nullptr) g_loaded = new std::vector<Loaded>;
  return *g_loaded;
}
std::atomic<bool> g_keep_loaded{false};

// At unload or exit: releases the tables and their libraries unless a transport ran on one.
struct ReleaseUnusedTables {
  ~ReleaseUnusedTables() {
    if (g_keep_loaded.load()) return;
    std::lock_guard<std::mutex> lock(g_loaded_mu);
    if (g_loaded == nullptr) return;
    for (Loaded& l : *g_loaded) {
      l.table.reset();
      if (l.lib != nullptr) dlclose(l.lib);
    }
    delete g_loaded;
    g_loaded = nullptr;
  }
} g_release_unused_tables;

}  // namespace

void KeepNcclLoaded() { g_keep_loaded.store(true); }

sdk::Result<const Nccl*> LoadNccl(const std::vector<std::string>& candidates) {
  if (candidates.empty()) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, "no NCCL: no library to try (no candidates)");
  }
  std::string tried;
  for (const std::string& path : candidates) {
    if (!tried.empty()) tried += "; ";
    dlerror();  // clear a stale one
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      tried += path + ": " + DlError("dlopen failed");
      continue;
    }
    auto bound = detail::Bind([lib](const char* name) { return dlsym(lib, name); });
    if (!bound.ok()) {
      tried += path + ": " + bound.status().message();
      dlclose(lib);
      continue;
    }
    std::unique_ptr<Nccl> n = std::move(bound).value();
    n->path = path;
    n->file = MappedFile(lib);
    if (n->file.empty()) n->file = path;
    const Nccl* out = n.get();
    std::lock_guard<std::mutex> lock(g_loaded_mu);
    LoadedTables().push_back({std::move(n), lib});
    return out;
  }
  return sdk::Status(KVB_ERR_UNAVAILABLE,
                     "no usable NCCL >= " + FormatNcclVersion(kMinNcclVersionCode) + " (tried " +
                         tried + "; KVBRIDGE_NCCL_LIBRARY names the one to use)");
}

std::vector<std::string> DefaultNcclCandidates() {
  const std::string forced = Env("KVBRIDGE_NCCL_LIBRARY");
  if (!forced.empty()) return {forced};

  std::vector<std::string> out;
  auto add = [&out](const std::string& p) {
    for (const std::string& have : out) {
      if (have == p) return;
    }
    out.push_back(p);
  };
  // PyPI's nvidia-nccl-cu* wheel, next to the Python that runs (or will run) kvbridge.
  const std::string pythonpath = Env("PYTHONPATH");
  size_t start = 0;
  while (start <= pythonpath.size()) {
    size_t end = pythonpath.find(':', start);
    if (end == std::string::npos) end = pythonpath.size();
    if (end > start) {
      const std::filesystem::path p =
          std::filesystem::path(pythonpath.substr(start, end - start)) / kWheelRelative;
      if (IsFile(p)) add(p.string());
    }
    start = end + 1;
  }
  const std::string venv = Env("VIRTUAL_ENV");
  if (!venv.empty()) {
    std::error_code ec;
    std::vector<std::string> found;
    for (std::filesystem::directory_iterator it(std::filesystem::path(venv) / "lib", ec), e;
         !ec && it != e; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.rfind("python", 0) != 0) continue;
      const std::filesystem::path p = it->path() / "site-packages" / kWheelRelative;
      if (IsFile(p)) found.push_back(p.string());
    }
    std::sort(found.begin(), found.end());  // a stable order when a venv has several Pythons
    for (const std::string& p : found) add(p);
  }
  add("libnccl.so.2");
  add("/usr/local/cuda/lib64/libnccl.so.2");
  return out;
}

sdk::Result<const Nccl*> LoadNcclOnce() {
  static const sdk::Result<const Nccl*> loaded = LoadNccl(DefaultNcclCandidates());
  return loaded;
}

sdk::Status ProbeNccl(const Nccl* nccl) {
  if (nccl == nullptr) return sdk::Status(KVB_ERR_UNAVAILABLE, "NCCL is not loaded");
  const std::string env = Env("KVBRIDGE_CUDA_DRIVER");
  detail::CudaProbe cuda;
  cuda.path = env.empty() ? kDefaultCudaDriver : env;
  dlerror();
  void* lib = dlopen(cuda.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, NcclName(*nccl) +
                                                " is loaded but there is no CUDA driver (" +
                                                cuda.path + ": " + DlError("dlopen failed") + ")");
  }
  // The driver stays loaded: it may hold threads and state after cuInit, and NCCL will use it.
  cuda.cuInit = reinterpret_cast<decltype(cuda.cuInit)>(dlsym(lib, "cuInit"));
  cuda.cuDeviceGetCount =
      reinterpret_cast<decltype(cuda.cuDeviceGetCount)>(dlsym(lib, "cuDeviceGetCount"));
  cuda.cuGetErrorName =
      reinterpret_cast<decltype(cuda.cuGetErrorName)>(dlsym(lib, "cuGetErrorName"));
  return detail::ProbeWith(*nccl, cuda);
}

}  // namespace kvbridge::nccl
