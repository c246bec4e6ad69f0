// The host key: which processes can reach each other's memory directly (System V / POSIX shared
// memory, process_vm_readv/writev) and mean the same process by a pid. Two processes with equal,
// non-empty keys share the boot (kernel), the IPC namespace and the pid namespace. Header-only:
// the core (descriptors, core/descriptor.h) and transport plugins (plugins/transport_ucx) use it.
#pragma once

#include <sys/stat.h>

#include <fstream>
#include <string>

namespace kvbridge::util {

// "<boot id>.<ipc namespace inode>.<pid namespace inode>", or "" when any part is unknown (an
// empty key is never the same host as anything).
inline std::string HostKey() {
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  struct stat ipc {};
  struct stat pidns {};
  if (boot.empty() || stat("/proc/self/ns/ipc", &ipc) != 0 ||
      stat("/proc/self/ns/pid", &pidns) != 0) {
    return "";
  }
  return boot + "." + std::to_string(static_cast<unsigned long long>(ipc.st_ino)) + "." +
         std::to_string(static_cast<unsigned long long>(pidns.st_ino));
}

}  // namespace kvbridge::util
