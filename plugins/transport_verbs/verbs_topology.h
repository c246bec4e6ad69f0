// kvbridge::verbs topology: which RDMA NIC ports ("rails") serve a memory location, and how one
// transfer is striped over the rails chosen. ReadNics and PciPathOf read sysfs
// (<root>/class/infiniband/<dev>/{device,ports/<n>/state,ports/<n>/link_layer},
// <root>/bus/pci/devices/<bus id>); Distance, ChooseRails and PlanStripes are pure functions of
// what they are given. Needs no libibverbs: the rails are chosen from sysfs alone, so the choice
// is table-tested without an RDMA device (tests/verbs/test_verbs_topology.cc).
// Thread-safety: every function may be called from any thread; none keeps state.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "kvbridge/plugin/sdk/common.hpp"

namespace kvbridge::verbs {

struct NicPort {
  uint32_t port = 0;      // 1-based: the directory name under <dev>/ports
  bool active = false;    // state "4: ACTIVE"
  bool ethernet = false;  // link_layer "Ethernet" (RoCE); otherwise InfiniBand
  std::string state;      // the name in the state file: "ACTIVE", "DOWN", "INIT", ...
};

struct Nic {
  std::string name;  // "mlx5_0"
  // The PCI addresses from the root port down to the NIC itself ("0000:10:01.0",
  // "0000:16:00.0", "0000:17:00.0"); empty for a device that is not on PCI (rxe, siw).
  std::vector<std::string> pci_path;
  int numa_node = -1;  // -1 when sysfs does not say (no numa_node file, or "-1")
  // Set when the device could not be read (named path and reason); its ports are then empty and
  // ChooseRails skips it.
  std::string error;
  std::vector<NicPort> ports;  // by port number
};

// Where the bytes of a transfer live.
struct Location {
  int numa_node = -1;   // of the host memory, or of the GPU; -1 when unknown
  std::string gpu_pci;  // CUDA bus id of the GPU holding device memory ("0000:18:00.0"); empty
                        // for host memory
};

struct Rail {
  std::string device;  // "mlx5_0"
  uint32_t port = 0;
  int distance = 0;  // Distance() of the device to the memory
};

// One piece of a striped transfer: bytes [offset, offset + length) go over rail `rail` (an
// index into the rails ChooseRails returned).
struct Stripe {
  uint32_t rail = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Distance penalties. Hops inside one root complex are a handful; these keep any rail of a
// closer class ahead of every rail of a farther one.
inline constexpr int kOtherRootComplexPenalty = 100;  // device memory, NIC under another root bus
inline constexpr int kOtherNumaPenalty = 100;         // NIC on another NUMA node than the memory

// Every RDMA device under <sysfs_root>/class/infiniband, sorted by name (natural order: mlx5_2
// before mlx5_10). A device whose `device` link is missing has an empty pci_path; one whose
// link does not resolve, whose ports cannot be listed, or whose port state or link_layer cannot
// be read or parsed, is kept with `error` naming the path and why (and no ports).
// A missing class/infiniband directory is an empty list (no RDMA device, not an error); one that
// exists but cannot be listed is KVB_ERR_IO naming the path.
plugin::sdk::Result<std::vector<Nic>> ReadNics(const std::string& sysfs_root);

// The PCI path (as Nic::pci_path) of the PCI device `bus_id` ("0000:18:00.0", as CUDA names it;
// upper-case hex and nvidia-smi's 8-digit domain "00000000:18:00.0" are accepted), from
// <sysfs_root>/bus/pci/devices/<bus id>. INVALID_ARGUMENT when bus_id is not a PCI address,
// NOT_FOUND naming the path when sysfs has no such device.
plugin::sdk::Result<std::vector<std::string>> PciPathOf(const std::string& sysfs_root,
                                                        const std::string& bus_id);

// How far `nic` is from the memory at `where` (smaller is closer).
// Device memory (where.gpu_pci set; gpu_path its PciPathOf): the PCIe hops between GPU and NIC,
// (gpu_path.size() - common) + (nic.pci_path.size() - common) where `common` counts the equal
// leading components; plus kOtherRootComplexPenalty when their root buses differ (the
// "dddd:bb" of the first components) or either path is empty (unknown); plus kOtherNumaPenalty
// when both NUMA nodes are known and differ.
// Host memory: 0 when the NUMA nodes are equal or either is unknown, else kOtherNumaPenalty.
int Distance(const Nic& nic, const Location& where, const std::vector<std::string>& gpu_path);

// The rails to use for memory at `where`, closest first: the ACTIVE ports of the devices
// without `error`, leaving out those in `failed` (keys "mlx5_0:1"), ordered by Distance, then
// device name (natural order), then port; at most max_rails of them (0: no limit). So all rails
// of the smallest distance come first, then those of the next distance.
// UNAVAILABLE when no port is eligible, naming each device and why (no port, port N DOWN,
// port N failed, its error).
plugin::sdk::Result<std::vector<Rail>> ChooseRails(const std::vector<Nic>& nics,
                                                   const Location& where,
                                                   const std::vector<std::string>& gpu_path,
                                                   uint32_t max_rails,
                                                   const std::set<std::string>& failed);

// How one transfer of `length` bytes is split over `rails` rails. The rules:
// - length 0, or rails 0 (a caller bug), is no stripe.
// - The stripes cover [0, length) exactly, in order, stripe i on rail i: contiguous, no gap, no
//   overlap.
// - Every stripe starts at a multiple of 4096 (a page, for the NIC and the GPU), so there are at
//   most ceil(length / 4096) stripes: a length of 4096 bytes or less is one stripe.
// - Within that, as many stripes as possible, at most `rails`, such that every stripe is at
//   least min_chunk bytes (0 counts as 1); one stripe (the whole length) when even two would
//   not be.
// - Nearly equal: the whole pages are dealt out evenly (the first stripes get one page more when
//   they do not divide) and the last stripe also takes the partial page at the end, so no two
//   stripes differ by more than 4096 bytes.
std::vector<Stripe> PlanStripes(uint64_t length, uint32_t rails, uint64_t min_chunk);

}  // namespace kvbridge::verbs
