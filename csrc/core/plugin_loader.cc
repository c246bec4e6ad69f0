#include "core/plugin_loader.h"

#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "util/logging.h"

namespace kvbridge::core {
namespace {

// Sizes of the ABI 1.0 structs: a plugin built against 1.0 hands us at least this much.
// Later minors append fields, so a larger struct_size is fine and a smaller one is not.
constexpr size_t kDescriptorV1Size =
    offsetof(kvb_plugin_descriptor_t, ops) + sizeof(kvb_plugin_descriptor_t::ops);
constexpr size_t kDescriptorVersionEnd =
    offsetof(kvb_plugin_descriptor_t, abi_minor) + sizeof(kvb_plugin_descriptor_t::abi_minor);
constexpr size_t kTransportOpsV1Size =
    offsetof(kvb_transport_ops_t, get_stats) + sizeof(kvb_transport_ops_t::get_stats);
constexpr size_t kStorageOpsV1Size =
    offsetof(kvb_storage_ops_t, for_each) + sizeof(kvb_storage_ops_t::for_each);
// ABI 1.1 appended put_meta and for_each_meta to the storage ops.
constexpr size_t kStorageOpsV1_1Size =
    offsetof(kvb_storage_ops_t, for_each_meta) + sizeof(kvb_storage_ops_t::for_each_meta);
// ABI 1.3 appended instance_caps to the transport ops.
constexpr size_t kTransportOpsV1_3Size =
    offsetof(kvb_transport_ops_t, instance_caps) + sizeof(kvb_transport_ops_t::instance_caps);
constexpr size_t kMaxNameLength = 64;
constexpr std::string_view kPluginPrefix = "libkvb_";
constexpr std::string_view kPluginSuffix = ".so";

struct Slot {
  const char* name;
  const void* fn;
  bool required;
};

std::vector<Slot> TransportSlots(const kvb_transport_ops_t& ops) {
  auto p = [](auto fn) { return reinterpret_cast<const void*>(fn); };
  std::vector<Slot> slots = {
      {"create", p(ops.create), true},
      {"destroy", p(ops.destroy), true},
      {"get_endpoints", p(ops.get_endpoints), true},
      {"register_memory", p(ops.register_memory), true},
      {"deregister_memory", p(ops.deregister_memory), true},
      {"add_peer", p(ops.add_peer), true},
      {"update_peer", p(ops.update_peer), true},
      {"remove_peer", p(ops.remove_peer), true},
      {"post", p(ops.post), true},
      {"poll", p(ops.poll), true},
      {"cancel", p(ops.cancel), true},
      {"release", p(ops.release), true},
      {"get_stats", p(ops.get_stats), false},
  };
  // The ABI 1.3 slot is checked only in a table long enough to hold it.
  if (ops.struct_size >= kTransportOpsV1_3Size) {
    slots.push_back({"instance_caps", p(ops.instance_caps), false});
  }
  return slots;
}

// The POOL slots are required of a plugin that declares POOL and optional (stubbed) otherwise;
// likewise the OBJECTS slots. The ABI 1.1 slots (put_meta, for_each_meta) are optional for every
// plugin and are checked only in a table long enough to hold them: a 1.0 table has none.
std::vector<Slot> StorageSlots(const kvb_storage_ops_t& ops, uint64_t caps) {
  auto p = [](auto fn) { return reinterpret_cast<const void*>(fn); };
  const bool pool = (caps & KVB_SCAP_POOL) != 0;
  const bool objects = (caps & KVB_SCAP_OBJECTS) != 0;
  std::vector<Slot> slots = {
      {"create", p(ops.create), true},    {"destroy", p(ops.destroy), true},
      {"usage", p(ops.usage), true},      {"get_segment", p(ops.get_segment), pool},
      {"alloc", p(ops.alloc), pool},      {"free", p(ops.free), pool},
      {"put", p(ops.put), objects},       {"get", p(ops.get), objects},
      {"remove", p(ops.remove), objects}, {"for_each", p(ops.for_each), objects},
  };
  if (StorageHasMetaOps(ops)) {
    slots.push_back({"put_meta", p(ops.put_meta), false});
    slots.push_back({"for_each_meta", p(ops.for_each_meta), false});
  }
  return slots;
}

Status CheckSlots(const std::vector<Slot>& slots, const std::string& path) {
  for (const Slot& s : slots) {
    if (s.fn != nullptr) continue;
    if (s.required) {
      return Status::InvalidArgument(path + ": required slot '" + s.name + "' is NULL");
    }
    return Status::InvalidArgument(path + ": optional slot '" + s.name +
                                   "' is NULL (point it to an unsupported stub)");
  }
  return Status::OK();
}

bool ValidName(const char* name) {
  if (name == nullptr || name[0] == '\0') return false;
  size_t n = 0;
  for (; name[n] != '\0'; ++n) {
    char c = name[n];
    bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
    if (!ok || n >= kMaxNameLength) return false;
  }
  return true;
}

const char* KindName(int32_t kind) {
  switch (kind) {
    case KVB_PLUGIN_TRANSPORT:
      return "transport";
    case KVB_PLUGIN_STORAGE:
      return "storage";
    default:
      return "unknown-kind";
  }
}

std::string Basename(std::string_view path) {
  size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

// dlopen failed. A dependency that cannot be found ("libucp.so.0: cannot open shared object
// file") means the plugin cannot run here: unavailable. Anything else (the plugin file itself
// missing or unreadable, a bad ELF, an undefined symbol) is a broken plugin: refused.
bool IsMissingDependency(const std::string& dlerr, const std::string& path) {
  static constexpr std::string_view kMarker = ": cannot open shared object file";
  size_t at = dlerr.find(kMarker);
  if (at == std::string::npos) return false;
  std::string_view head(dlerr.data(), at);
  size_t sep = head.rfind(": ");
  std::string_view missing = sep == std::string_view::npos ? head : head.substr(sep + 2);
  return Basename(missing) != Basename(path);
}

std::vector<std::string> SplitPath(std::string_view list) {
  std::vector<std::string> out;
  while (!list.empty()) {
    size_t colon = list.find(':');
    std::string_view item = list.substr(0, colon);
    if (!item.empty()) out.emplace_back(item);
    if (colon == std::string_view::npos) break;
    list.remove_prefix(colon + 1);
  }
  return out;
}

std::string Canonical(const std::string& path) {
  char buf[PATH_MAX];
  if (realpath(path.c_str(), buf) == nullptr) return path;
  return buf;
}

bool IsPluginFileName(std::string_view name) {
  return name.size() > kPluginPrefix.size() + kPluginSuffix.size() &&
         name.starts_with(kPluginPrefix) && name.ends_with(kPluginSuffix);
}

std::string JoinDirs(const std::vector<std::string>& dirs) {
  if (dirs.empty()) return "(no directory searched)";
  std::string out;
  for (const auto& d : dirs) {
    if (!out.empty()) out += ':';
    out += d;
  }
  return out;
}

}  // namespace

const kvb_transport_ops_t* PluginInfo::transport_ops() const {
  if (state != PluginState::kLoaded || kind != KVB_PLUGIN_TRANSPORT || descriptor == nullptr) {
    return nullptr;
  }
  return static_cast<const kvb_transport_ops_t*>(descriptor->ops);
}

bool TransportHasInstanceCaps(const kvb_transport_ops_t& ops) {
  return ops.struct_size >= kTransportOpsV1_3Size;
}

bool StorageHasMetaOps(const kvb_storage_ops_t& ops) {
  return ops.struct_size >= kStorageOpsV1_1Size;
}

const kvb_storage_ops_t* PluginInfo::storage_ops() const {
  if (state != PluginState::kLoaded || kind != KVB_PLUGIN_STORAGE || descriptor == nullptr) {
    return nullptr;
  }
  return static_cast<const kvb_storage_ops_t*>(descriptor->ops);
}

Status ValidateDescriptor(const kvb_plugin_descriptor_t* desc, const std::string& path) {
  if (desc == nullptr) return Status::InvalidArgument(path + ": descriptor is NULL");
  // The version fields sit right after struct_size in every major; read them before judging
  // the rest of the layout, so a plugin of another major gets the version message.
  if (desc->struct_size < kDescriptorVersionEnd) {
    return Status::InvalidArgument(path + ": descriptor struct_size " +
                                   std::to_string(desc->struct_size) +
                                   " is too small to hold the ABI version");
  }
  if (desc->abi_major != KVB_ABI_MAJOR) {
    return Status::InvalidArgument(path + ": ABI major " + std::to_string(desc->abi_major) +
                                   ", host speaks " + std::to_string(KVB_ABI_MAJOR) +
                                   " (rebuild the plugin against this kvbridge's headers)");
  }
  if (desc->struct_size < kDescriptorV1Size) {
    return Status::InvalidArgument(path + ": descriptor struct_size " +
                                   std::to_string(desc->struct_size) + " is smaller than ABI " +
                                   std::to_string(KVB_ABI_MAJOR) + ".0's " +
                                   std::to_string(kDescriptorV1Size));
  }
  if (!ValidName(desc->name)) {
    return Status::InvalidArgument(path + ": plugin name '" +
                                   std::string(desc->name ? desc->name : "(null)") +
                                   "' must be 1-64 characters of [a-z0-9_]");
  }
  if (desc->kind != KVB_PLUGIN_TRANSPORT && desc->kind != KVB_PLUGIN_STORAGE) {
    return Status::InvalidArgument(path + ": unknown plugin kind " + std::to_string(desc->kind));
  }
  if (desc->probe == nullptr) return Status::InvalidArgument(path + ": probe is NULL");
  if (desc->ops == nullptr) return Status::InvalidArgument(path + ": ops table is NULL");

  const uint64_t caps = desc->caps;
  if (desc->kind == KVB_PLUGIN_TRANSPORT) {
    const auto* ops = static_cast<const kvb_transport_ops_t*>(desc->ops);
    if (ops->struct_size < kTransportOpsV1Size) {
      return Status::InvalidArgument(path + ": transport ops struct_size " +
                                     std::to_string(ops->struct_size) + " is smaller than ABI " +
                                     std::to_string(KVB_ABI_MAJOR) + ".0's " +
                                     std::to_string(kTransportOpsV1Size));
    }
    KVB_RETURN_IF_ERROR(CheckSlots(TransportSlots(*ops), path));
    if ((caps & (KVB_TCAP_READ | KVB_TCAP_WRITE)) == 0) {
      return Status::InvalidArgument(path + ": transport caps declare neither READ nor WRITE");
    }
    if ((caps & (KVB_TCAP_HOST_MEM | KVB_TCAP_CUDA_MEM)) == 0) {
      return Status::InvalidArgument(path +
                                     ": transport caps declare neither HOST_MEM nor CUDA_MEM");
    }
  } else {
    const auto* ops = static_cast<const kvb_storage_ops_t*>(desc->ops);
    if (ops->struct_size < kStorageOpsV1Size) {
      return Status::InvalidArgument(path + ": storage ops struct_size " +
                                     std::to_string(ops->struct_size) + " is smaller than ABI " +
                                     std::to_string(KVB_ABI_MAJOR) + ".0's " +
                                     std::to_string(kStorageOpsV1Size));
    }
    if ((caps & (KVB_SCAP_POOL | KVB_SCAP_OBJECTS)) == 0) {
      return Status::InvalidArgument(path + ": storage caps declare neither POOL nor OBJECTS");
    }
    KVB_RETURN_IF_ERROR(CheckSlots(StorageSlots(*ops, caps), path));
  }
  // Capability bits beyond this host's known mask come from a newer minor: ignored, not refused.
  return Status::OK();
}

PluginRegistry::~PluginRegistry() {
  for (auto it = handles_.rbegin(); it != handles_.rend(); ++it) dlclose(*it);
}

PluginRegistry::PluginRegistry(PluginRegistry&& other) noexcept
    : plugins_(std::move(other.plugins_)),
      handles_(std::move(other.handles_)),
      searched_(std::move(other.searched_)) {
  other.plugins_.clear();
  other.handles_.clear();
  other.searched_.clear();
}

PluginRegistry& PluginRegistry::operator=(PluginRegistry&& other) noexcept {
  if (this != &other) {
    PluginRegistry old(std::move(*this));  // closes our libraries when it goes out of scope
    plugins_ = std::move(other.plugins_);
    handles_ = std::move(other.handles_);
    searched_ = std::move(other.searched_);
    other.plugins_.clear();
    other.handles_.clear();
    other.searched_.clear();
  }
  return *this;
}

std::vector<std::string> PluginRegistry::DefaultSearchPath(const std::string& extra) {
  std::vector<std::string> dirs = SplitPath(extra);
  if (const char* env = std::getenv("KVBRIDGE_PLUGIN_PATH")) {
    for (auto& d : SplitPath(env)) dirs.push_back(std::move(d));
  }
  // Next to the library: an installed package keeps its plugins in <libdir>/plugins (the
  // Python wheel) or <libdir>/kvbridge/plugins (`cmake --install`, CMAKE_INSTALL_LIBDIR). The
  // build tree's plugin directory is searched only by a library that still lives in the build
  // tree and has no installed plugin directory next to it, so an installed copy never picks up
  // plugins from the tree it was built in, even when installed into a prefix inside that tree.
  std::string lib_dir;
  Dl_info info;
  if (dladdr(reinterpret_cast<const void*>(&ValidateDescriptor), &info) != 0 &&
      info.dli_fname != nullptr) {
    std::string lib = info.dli_fname;
    size_t slash = lib.rfind('/');
    lib_dir = slash == std::string::npos ? "." : lib.substr(0, slash);
    // A program started by a relative path gets a relative name for its own module (the test
    // binaries link the loader statically): search absolute directories all the same.
    if (lib_dir.empty() || lib_dir[0] != '/') lib_dir = Canonical(lib_dir);
  }
#ifdef KVBRIDGE_BUILD_PLUGIN_DIR
  const std::string build_root = KVBRIDGE_BUILD_ROOT;
  auto is_dir = [](const std::string& d) {
    DIR* h = opendir(d.c_str());
    if (h == nullptr) return false;
    closedir(h);
    return true;
  };
  bool installed =
      !lib_dir.empty() && (is_dir(lib_dir + "/plugins") || is_dir(lib_dir + "/kvbridge/plugins"));
  bool in_build_tree =
      !installed &&
      (lib_dir.empty() || (Canonical(lib_dir) + "/").rfind(Canonical(build_root) + "/", 0) == 0);
  if (in_build_tree) dirs.emplace_back(KVBRIDGE_BUILD_PLUGIN_DIR);
#endif
  if (!lib_dir.empty()) {
    dirs.push_back(lib_dir + "/plugins");
    dirs.push_back(lib_dir + "/kvbridge/plugins");
  }
  std::vector<std::string> unique;
  for (auto& d : dirs) {
    if (std::find(unique.begin(), unique.end(), d) == unique.end()) unique.push_back(std::move(d));
  }
  return unique;
}

void PluginRegistry::Scan(const std::vector<std::string>& dirs) {
  // The same directory or file reached twice (listed twice, a symlink) is scanned and loaded
  // once; it is not a duplicate plugin.
  std::vector<std::string> seen_dirs;
  std::vector<std::string> seen_files;
  for (const PluginInfo& p : plugins_) seen_files.push_back(Canonical(p.path));
  for (const auto& dir : dirs) {
    std::string canonical_dir = Canonical(dir);
    if (std::find(seen_dirs.begin(), seen_dirs.end(), canonical_dir) != seen_dirs.end()) continue;
    seen_dirs.push_back(canonical_dir);
    searched_.push_back(dir);

    DIR* d = opendir(dir.c_str());
    if (d == nullptr) continue;
    std::vector<std::string> names;
    while (struct dirent* e = readdir(d)) {
      if (IsPluginFileName(e->d_name)) names.emplace_back(e->d_name);
    }
    closedir(d);
    std::sort(names.begin(), names.end());
    for (const auto& name : names) {
      std::string path = dir + "/" + name;
      std::string real = Canonical(path);
      if (std::find(seen_files.begin(), seen_files.end(), real) != seen_files.end()) continue;
      seen_files.push_back(real);
      LoadFile(path);
    }
  }
}

const PluginInfo& PluginRegistry::LoadFile(const std::string& path) {
  PluginInfo info;
  info.path = path;
  void* handle = nullptr;

  // Fills `info` and returns the handle to keep (loaded), or null after closing it.
  auto classify = [&]() -> void* {
    dlerror();
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* err = dlerror();
      std::string msg = err ? err : "dlopen failed";
      info.state =
          IsMissingDependency(msg, path) ? PluginState::kUnavailable : PluginState::kRefused;
      info.reason = info.state == PluginState::kUnavailable
                        ? path + ": a library it needs is missing: " + msg
                        : path + ": cannot be loaded: " + msg;
      return nullptr;
    }
    auto query = reinterpret_cast<kvb_plugin_query_fn>(dlsym(handle, KVB_PLUGIN_QUERY_SYMBOL));
    if (query == nullptr) {
      info.reason = path + ": no '" KVB_PLUGIN_QUERY_SYMBOL "' symbol (not a kvbridge plugin)";
      return nullptr;
    }
    const kvb_plugin_descriptor_t* desc = query(KVB_ABI_MAJOR, KVB_ABI_MINOR);
    if (desc == nullptr) {
      info.reason = path + ": " KVB_PLUGIN_QUERY_SYMBOL "(" + std::to_string(KVB_ABI_MAJOR) + ", " +
                    std::to_string(KVB_ABI_MINOR) +
                    ") returned NULL: the plugin does not support host ABI " +
                    std::to_string(KVB_ABI_MAJOR) + ".x";
      return nullptr;
    }
    Status valid = ValidateDescriptor(desc, path);
    // Name and kind are worth keeping even for a refused plugin (Find() reports why it is not
    // usable), but only when the descriptor has this major's layout.
    if (desc->struct_size >= kDescriptorV1Size && desc->abi_major == KVB_ABI_MAJOR &&
        ValidName(desc->name)) {
      info.name = desc->name;
      info.kind = desc->kind;
      info.caps = desc->caps;
      info.version = desc->version ? desc->version : "";
    }
    if (!valid.ok()) {
      info.reason = valid.message();
      return nullptr;
    }
    for (const PluginInfo& p : plugins_) {
      if (p.state == PluginState::kLoaded && p.kind == info.kind && p.name == info.name) {
        info.reason = path + ": " + KindName(info.kind) + " plugin '" + info.name +
                      "' is a duplicate of " + p.path;
        return nullptr;
      }
    }
    char why[512] = {0};
    kvb_status_t st = desc->probe(why, sizeof(why));
    why[sizeof(why) - 1] = '\0';
    if (st == KVB_ERR_UNAVAILABLE) {
      info.state = PluginState::kUnavailable;
      info.reason = path + ": " + KindName(info.kind) + " plugin '" + info.name +
                    "' is unavailable here: " + (why[0] ? why : "(no reason given)");
      return nullptr;
    }
    if (st != KVB_OK) {
      info.reason = path + ": probe returned " + StatusCodeName(static_cast<StatusCode>(st)) +
                    " (only OK or UNAVAILABLE are allowed): " + why;
      return nullptr;
    }
    info.state = PluginState::kLoaded;
    info.descriptor = desc;
    return handle;
  };

  void* keep = classify();
  if (keep != nullptr) {
    handles_.push_back(keep);
  } else if (handle != nullptr) {
    dlclose(handle);
  }
  if (info.state == PluginState::kRefused) {
    KVB_LOG(WARN) << "plugin refused: " << info.reason;
  } else if (info.state == PluginState::kUnavailable) {
    // Expected on machines without the plugin's library or device; the engine reports it when
    // the user asked for that plugin by name.
    KVB_LOG(INFO) << "plugin unavailable: " << info.reason;
  } else {
    KVB_LOG(DEBUG) << "plugin loaded: " << KindName(info.kind) << " '" << info.name << "' from "
                   << path;
  }
  plugins_.push_back(std::move(info));
  return plugins_.back();
}

const PluginInfo* PluginRegistry::Find(int32_t kind, const std::string& name,
                                       std::string* why_not) const {
  // A plugin refused before its descriptor could be read (e.g. its system library is missing)
  // has no name; it is recognised by the file naming convention instead.
  const std::string by_file = std::string(kPluginPrefix) + KindName(kind) + "_" + name + ".so";
  const PluginInfo* unusable = nullptr;
  for (const PluginInfo& p : plugins_) {
    bool match = p.name.empty() ? Basename(p.path) == by_file : p.kind == kind && p.name == name;
    if (!match) continue;
    if (p.state == PluginState::kLoaded) return &p;
    if (unusable == nullptr) unusable = &p;
  }
  if (why_not != nullptr) {
    *why_not = unusable != nullptr ? unusable->reason
                                   : std::string("no ") + KindName(kind) + " plugin named '" +
                                         name + "' found in " + JoinDirs(searched_);
  }
  return nullptr;
}

std::vector<const PluginInfo*> PluginRegistry::Loaded(int32_t kind) const {
  std::vector<const PluginInfo*> out;
  for (const PluginInfo& p : plugins_) {
    if (p.state == PluginState::kLoaded && p.kind == kind) out.push_back(&p);
  }
  return out;
}

}  // namespace kvbridge::core
