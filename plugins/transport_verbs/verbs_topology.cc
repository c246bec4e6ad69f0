#include "verbs_topology.h"

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;

constexpr uint64_t kPage = 4096;

bool IsHex(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

bool AllHex(std::string_view s) { return !s.empty() && std::all_of(s.begin(), s.end(), IsHex); }

// "dddd:bb:dd.f": a domain of 4 or more hex digits (VMD domains have 5), bus, device, function.
bool IsPciAddress(std::string_view s) {
  const size_t c1 = s.find(':');
  if (c1 == std::string_view::npos || c1 < 4 || !AllHex(s.substr(0, c1))) return false;
  const std::string_view rest = s.substr(c1 + 1);
  return rest.size() == 7 && AllHex(rest.substr(0, 2)) && rest[2] == ':' &&
         AllHex(rest.substr(3, 2)) && rest[5] == '.' && rest[6] >= '0' && rest[6] <= '7';
}

// Less-than that compares runs of digits by value: "mlx5_2" < "mlx5_10".
bool NaturalLess(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = a[i] >= '0' && a[i] <= '9', db = b[j] >= '0' && b[j] <= '9';
    if (da && db) {
      size_t ei = i, ej = j;
      while (ei < a.size() && a[ei] >= '0' && a[ei] <= '9') ++ei;
      while (ej < b.size() && b[ej] >= '0' && b[ej] <= '9') ++ej;
      size_t zi = i, zj = j;  // skip leading zeros, then the longer run is the larger number
      while (zi + 1 < ei && a[zi] == '0') ++zi;
      while (zj + 1 < ej && b[zj] == '0') ++zj;
      if (ei - zi != ej - zj) return ei - zi < ej - zj;
      if (const int c = a.compare(zi, ei - zi, b, zj, ej - zj); c != 0) return c < 0;
      i = ei;
      j = ej;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

// The first line of a (sysfs) file, without its newline; errno when it cannot be read.
int ReadLine(const std::string& path, std::string* line) {
  FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return errno;
  char buf[256];
  const bool got = std::fgets(buf, sizeof(buf), f) != nullptr;
  const int err = std::ferror(f) ? errno : 0;
  std::fclose(f);
  if (err != 0) return err;
  *line = got ? buf : "";
  while (!line->empty() && (line->back() == '\n' || line->back() == ' ')) line->pop_back();
  return 0;
}

// The names in a directory but "." and "..", unsorted; errno when it cannot be listed.
int ListDir(const std::string& path, std::vector<std::string>* names) {
  DIR* d = opendir(path.c_str());
  if (d == nullptr) return errno;
  while (const dirent* e = readdir(d)) {
    const std::string_view n = e->d_name;
    if (n != "." && n != "..") names->emplace_back(n);
  }
  closedir(d);
  return 0;
}

std::string Why(const std::string& what, const std::string& path, int err) {
  return what + " " + path + ": " + std::strerror(err);
}

// The PCI addresses among the components of `path` once its symlinks are resolved: a device's
// directory under /sys/devices/pci<domain>:<bus>/ is named by its chain of bridges.
int ResolvePciPath(const std::string& path, std::vector<std::string>* pci_path) {
  char* real = realpath(path.c_str(), nullptr);
  if (real == nullptr) return errno;
  const std::string_view s = real;
  for (size_t start = 0; start < s.size();) {
    size_t end = s.find('/', start);
    if (end == std::string_view::npos) end = s.size();
    if (const std::string_view c = s.substr(start, end - start); IsPciAddress(c)) {
      pci_path->emplace_back(c);
    }
    start = end + 1;
  }
  free(real);
  return 0;
}

// Ports of the device at `dir`; the reason in *error when one cannot be read.
std::vector<NicPort> ReadPorts(const std::string& dir, std::string* error) {
  const std::string ports_dir = dir + "/ports";
  std::vector<std::string> names;
  if (const int err = ListDir(ports_dir, &names); err != 0) {
    *error = Why("cannot list", ports_dir, err);
    return {};
  }
  std::vector<NicPort> ports;
  for (const std::string& name : names) {
    const std::string pdir = ports_dir + "/" + name;
    char* end = nullptr;
    const unsigned long n = std::strtoul(name.c_str(), &end, 10);
    if (name.empty() || *end != '\0' || n == 0 || n > UINT32_MAX) {
      *error = "port directory " + pdir + " is not named by a port number";
      return {};
    }
    NicPort port;
    port.port = static_cast<uint32_t>(n);
    // "4: ACTIVE": the ib_port_state number, then its name.
    std::string state;
    if (const int err = ReadLine(pdir + "/state", &state); err != 0) {
      *error = Why("cannot read", pdir + "/state", err);
      return {};
    }
    const size_t colon = state.find(": ");
    const std::string number = state.substr(0, colon);
    if (colon == std::string::npos || number.empty() ||
        !std::all_of(number.begin(), number.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        colon + 2 >= state.size()) {
      *error = pdir + "/state: '" + state + "' is not '<number>: <name>'";
      return {};
    }
    port.active = number == "4";  // IB_PORT_ACTIVE
    port.state = state.substr(colon + 2);
    std::string link_layer;
    if (const int err = ReadLine(pdir + "/link_layer", &link_layer); err != 0) {
      *error = Why("cannot read", pdir + "/link_layer", err);
      return {};
    }
    port.ethernet = link_layer == "Ethernet";
    ports.push_back(port);
  }
  std::sort(ports.begin(), ports.end(),
            [](const NicPort& a, const NicPort& b) { return a.port < b.port; });
  return ports;
}

Nic ReadNic(const std::string& class_dir, const std::string& name) {
  Nic nic;
  nic.name = name;
  const std::string dir = class_dir + "/" + name;
  const std::string device = dir + "/device";
  if (const int err = ResolvePciPath(device, &nic.pci_path); err != 0) {
    // No `device` link at all: a software device (rxe, siw) with no PCI function of its own.
    struct stat st;
    if (err != ENOENT || lstat(device.c_str(), &st) == 0) {
      nic.error = Why("cannot resolve", device, err);
      return nic;
    }
  }
  std::string numa;
  if (ReadLine(device + "/numa_node", &numa) == 0 && !numa.empty()) {
    char* end = nullptr;
    const long n = std::strtol(numa.c_str(), &end, 10);
    if (*end != '\0' || n < -1 || n > INT32_MAX) {
      nic.error = device + "/numa_node: '" + numa + "' is not a NUMA node";
      return nic;
    }
    nic.numa_node = static_cast<int>(n);
  }
  nic.ports = ReadPorts(dir, &nic.error);
  return nic;
}

// "0000:10" of "0000:10:01.0": the root bus, one per root complex (host bridge).
std::string_view RootBus(const std::string& first) {
  return std::string_view(first).substr(0, first.rfind(':'));
}

std::string Where(const Location& where) {
  if (!where.gpu_pci.empty()) return "memory of GPU " + where.gpu_pci;
  if (where.numa_node < 0) return "host memory";
  return "host memory on NUMA node " + std::to_string(where.numa_node);
}

}  // namespace

sdk::Result<std::vector<Nic>> ReadNics(const std::string& sysfs_root) {
  const std::string class_dir = sysfs_root + "/class/infiniband";
  std::vector<std::string> names;
  if (const int err = ListDir(class_dir, &names); err != 0) {
    if (err == ENOENT) return std::vector<Nic>{};  // no RDMA driver loaded
    return sdk::Status(KVB_ERR_IO, Why("cannot list", class_dir, err));
  }
  std::sort(names.begin(), names.end(), NaturalLess);
  std::vector<Nic> nics;
  nics.reserve(names.size());
  for (const std::string& name : names) nics.push_back(ReadNic(class_dir, name));
  return nics;
}

sdk::Result<std::vector<std::string>> PciPathOf(const std::string& sysfs_root,
                                                const std::string& bus_id) {
  if (!IsPciAddress(bus_id)) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "'" + bus_id + "' is not a PCI bus id (dddd:bb:dd.f)");
  }
  std::string id = bus_id;
  std::transform(id.begin(), id.end(), id.begin(), [](char c) {
    return c >= 'A' && c <= 'F' ? static_cast<char>(c - 'A' + 'a') : c;
  });
  // nvidia-smi writes an 8-digit domain, sysfs 4 (more only for domains that need them).
  const size_t leading = std::min(id.find(':') - 4, id.find_first_not_of('0'));
  id.erase(0, leading);
  const std::string path = sysfs_root + "/bus/pci/devices/" + id;
  std::vector<std::string> pci_path;
  if (const int err = ResolvePciPath(path, &pci_path); err != 0) {
    return sdk::Status(err == ENOENT ? KVB_ERR_NOT_FOUND : KVB_ERR_IO,
                       Why("no PCI device " + bus_id + ":", path, err));
  }
  if (pci_path.empty()) {
    return sdk::Status(KVB_ERR_NOT_FOUND,
                       "PCI device " + bus_id + ": " + path + " resolves to no PCI path");
  }
  return pci_path;
}

int Distance(const Nic& nic, const Location& where, const std::vector<std::string>& gpu_path) {
  const bool numa_differs =
      where.numa_node >= 0 && nic.numa_node >= 0 && where.numa_node != nic.numa_node;
  const int numa = numa_differs ? kOtherNumaPenalty : 0;
  if (where.gpu_pci.empty()) return numa;
  const std::vector<std::string>& nic_path = nic.pci_path;
  size_t common = 0;
  while (common < gpu_path.size() && common < nic_path.size() &&
         gpu_path[common] == nic_path[common]) {
    ++common;
  }
  const int hops = static_cast<int>(gpu_path.size() - common + nic_path.size() - common);
  const bool same_root = !gpu_path.empty() && !nic_path.empty() &&
                         RootBus(gpu_path.front()) == RootBus(nic_path.front());
  return hops + (same_root ? 0 : kOtherRootComplexPenalty) + numa;
}

sdk::Result<std::vector<Rail>> ChooseRails(const std::vector<Nic>& nics, const Location& where,
                                           const std::vector<std::string>& gpu_path,
                                           uint32_t max_rails,
                                           const std::set<std::string>& failed) {
  std::vector<Rail> rails;
  std::string why;  // per device, for the UNAVAILABLE message
  for (const Nic& nic : nics) {
    std::string skipped;
    const auto skip = [&](const std::string& reason) {
      skipped += (skipped.empty() ? "" : ", ") + reason;
    };
    if (!nic.error.empty()) {
      skip(nic.error);
    } else {
      if (nic.ports.empty()) skip("no port");
      const int distance = Distance(nic, where, gpu_path);
      for (const NicPort& p : nic.ports) {
        const std::string port = "port " + std::to_string(p.port);
        if (!p.active) {
          skip(port + " " + (p.state.empty() ? "not active" : p.state));
        } else if (failed.count(nic.name + ":" + std::to_string(p.port)) != 0) {
          skip(port + " failed");
        } else {
          rails.push_back(Rail{nic.name, p.port, distance});
        }
      }
    }
    if (!skipped.empty()) why += (why.empty() ? "" : "; ") + nic.name + ": " + skipped;
  }
  if (rails.empty()) {
    return sdk::Status(KVB_ERR_UNAVAILABLE, "no RDMA port to use for " + Where(where) + ": " +
                                                (nics.empty() ? "no RDMA device" : why));
  }
  std::sort(rails.begin(), rails.end(), [](const Rail& a, const Rail& b) {
    if (a.distance != b.distance) return a.distance < b.distance;
    if (a.device != b.device) return NaturalLess(a.device, b.device);
    return a.port < b.port;
  });
  if (max_rails != 0 && rails.size() > max_rails) rails.resize(max_rails);
  return rails;
}

std::vector<Stripe> PlanStripes(uint64_t length, uint32_t rails, uint64_t min_chunk) {
  if (length == 0 || rails == 0) return {};
  const uint64_t min_piece = std::max<uint64_t>(min_chunk, 1);
  const uint64_t pages = length / kPage, tail = length % kPage;
  // The largest stripe count, at most one per page begun, whose smallest stripe is at least
  // min_piece; 1 always qualifies.
  uint64_t n = std::min<uint64_t>(
      {rails, std::max<uint64_t>(length / min_piece, 1), pages + (tail != 0 ? 1 : 0)});
  for (; n > 1; --n) {
    const uint64_t base = pages / n, extra = pages % n;
    // The first `extra` stripes have base + 1 pages, the last base pages and the tail: when the
    // extra pages stop short of the one before it, that one (base pages) is the smallest.
    const uint64_t smallest = extra + 1 < n ? base * kPage : base * kPage + tail;
    if (smallest >= min_piece) break;
  }
  std::vector<Stripe> out;
  out.reserve(n);
  uint64_t offset = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t len =
        i + 1 == n ? length - offset : (pages / n + (i < pages % n ? 1 : 0)) * kPage;
    out.push_back(Stripe{static_cast<uint32_t>(i), offset, len});
    offset += len;
  }
  return out;
}

}  // namespace kvbridge::verbs
