// verbs topology (plugins/transport_verbs/verbs_topology.h) against a fake sysfs tree laid out as
// Linux lays it out: two PCI root complexes (pci0000:10 on NUMA node 0, pci0000:80 on node 1),
// each with a PCIe switch holding a GPU and RDMA NICs, plus a NIC straight under a second root
// port and one whose ports cannot be read. Also the stripe plan, by table and by property.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "verbs_topology.h"

namespace kvbridge::verbs {
namespace {

namespace fs = std::filesystem;
using Path = std::vector<std::string>;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

// A sysfs root in a fresh temp directory, removed at the end of the test.
class FakeSysfs {
 public:
  FakeSysfs() {
    std::string tmpl = (fs::temp_directory_path() / "kvb_topo_XXXXXX").string();
    if (mkdtemp(tmpl.data()) != nullptr) root_ = tmpl;
  }
  ~FakeSysfs() {
    std::error_code ec;
    if (!root_.empty()) fs::remove_all(root_, ec);
  }
  const std::string& root() const { return root_; }

  void Write(const std::string& rel, const std::string& content) {
    fs::create_directories(fs::path(root_ + "/" + rel).parent_path());
    std::ofstream(root_ + "/" + rel) << content;
  }
  void Link(const std::string& rel, const std::string& target) {
    fs::create_directories(fs::path(root_ + "/" + rel).parent_path());
    fs::create_directory_symlink(target, root_ + "/" + rel);
  }
  // A PCI function at devices/<pci>, with a numa_node file when numa is set.
  void PciDevice(const std::string& pci, std::optional<std::string> numa) {
    fs::create_directories(root_ + "/devices/" + pci);
    if (numa) Write("devices/" + pci + "/numa_node", *numa + "\n");
  }
  // bus/pci/devices/<bus id> -> ../../../devices/<pci>, as Linux links it.
  void BusLink(const std::string& pci) {
    Link("bus/pci/devices/" + pci.substr(pci.rfind('/') + 1), "../../../devices/" + pci);
  }
  // ports/<n>/{state,link_layer} under `dir` (relative to the root), ports numbered from 1.
  void Ports(const std::string& dir, const std::vector<std::pair<std::string, std::string>>& ps) {
    for (size_t i = 0; i < ps.size(); ++i) {
      const std::string port = dir + "/ports/" + std::to_string(i + 1);
      Write(port + "/state", ps[i].first + "\n");
      Write(port + "/link_layer", ps[i].second + "\n");
    }
  }
  // class/infiniband/<name> as a directory whose `device` links to devices/<pci>.
  void Nic(const std::string& name, const std::string& pci,
           const std::vector<std::pair<std::string, std::string>>& ports) {
    const std::string dir = "class/infiniband/" + name;
    Link(dir + "/device", "../../../devices/" + pci);
    Ports(dir, ports);
  }
  // As the kernel has it: class/infiniband/<name> -> ../../devices/<pci>/infiniband/<name>,
  // whose `device` is ../../../<function>.
  void KernelLayoutNic(const std::string& name, const std::string& pci,
                       const std::vector<std::pair<std::string, std::string>>& ports) {
    const std::string dir = "devices/" + pci + "/infiniband/" + name;
    Link(dir + "/device", "../../../" + pci.substr(pci.rfind('/') + 1));
    Ports(dir, ports);
    Link("class/infiniband/" + name, "../../" + dir);
  }

 private:
  std::string root_;
};

const std::pair<std::string, std::string> kActiveIb{"4: ACTIVE", "InfiniBand"};
const std::pair<std::string, std::string> kActiveEth{"4: ACTIVE", "Ethernet"};
const std::pair<std::string, std::string> kDownIb{"1: DOWN", "InfiniBand"};

const std::string kSwitch0 = "pci0000:10/0000:10:01.0/0000:16:00.0";
const std::string kSwitch1 = "pci0000:80/0000:80:01.0/0000:81:00.0";
const Path kGpu0Path{"0000:10:01.0", "0000:16:00.0", "0000:18:00.0"};
const Path kGpu1Path{"0000:80:01.0", "0000:81:00.0", "0000:8a:00.0"};

// Root complex 0 (NUMA 0): GPU 0000:18:00.0 and mlx5_0 under one switch; mlx5_3 (ports 1 ACTIVE,
// 2 DOWN, no numa_node file) under another root port of the same root bus.
// Root complex 1 (NUMA 1): GPU 0000:8a:00.0 and mlx5_1, mlx5_2 (RoCE, the two functions of one
// card) under one switch; mlx5_4, numa_node "-1", whose ports directory is missing.
class VerbsTopologyTree : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(sys_.root().empty()) << "mkdtemp failed";
    sys_.PciDevice(kSwitch0 + "/0000:17:00.0", "0");
    sys_.Nic("mlx5_0", kSwitch0 + "/0000:17:00.0", {kActiveIb});
    sys_.PciDevice(kSwitch0 + "/0000:18:00.0", "0");
    sys_.BusLink(kSwitch0 + "/0000:18:00.0");
    sys_.PciDevice("pci0000:10/0000:10:02.0/0000:20:00.0", std::nullopt);
    sys_.Nic("mlx5_3", "pci0000:10/0000:10:02.0/0000:20:00.0", {kActiveIb, kDownIb});

    sys_.PciDevice(kSwitch1 + "/0000:82:00.0", "1");
    sys_.KernelLayoutNic("mlx5_1", kSwitch1 + "/0000:82:00.0", {kActiveEth});
    sys_.PciDevice(kSwitch1 + "/0000:82:00.1", "1");
    sys_.Nic("mlx5_2", kSwitch1 + "/0000:82:00.1", {kActiveEth});
    sys_.PciDevice(kSwitch1 + "/0000:8a:00.0", "1");
    sys_.BusLink(kSwitch1 + "/0000:8a:00.0");
    sys_.PciDevice("pci0000:80/0000:80:02.0/0000:90:00.0", "-1");
    sys_.Link("class/infiniband/mlx5_4/device",
              "../../../devices/pci0000:80/0000:80:02.0/0000:90:00.0");

    auto nics = ReadNics(sys_.root());
    ASSERT_TRUE(nics.ok()) << nics.status().message();
    nics_ = *nics;
  }

  // "mlx5_0:1@2, mlx5_3:1@5": rails with their distances, for one comparison per case.
  static std::string Describe(const std::vector<Rail>& rails) {
    std::string s;
    for (const Rail& r : rails) {
      s += (s.empty() ? "" : ", ") + r.device + ":" + std::to_string(r.port) + "@" +
           std::to_string(r.distance);
    }
    return s;
  }

  std::string Choose(const Location& where, const Path& gpu_path, uint32_t max_rails,
                     const std::set<std::string>& failed = {}) {
    auto rails = ChooseRails(nics_, where, gpu_path, max_rails, failed);
    if (!rails.ok()) return "error: " + rails.status().message();
    return Describe(*rails);
  }

  FakeSysfs sys_;
  std::vector<Nic> nics_;
};

TEST_F(VerbsTopologyTree, ReadsEveryNicWithItsPciPathNumaNodeAndPorts) {
  ASSERT_EQ(nics_.size(), 5u);
  const Nic& n0 = nics_[0];
  EXPECT_EQ(n0.name, "mlx5_0");
  EXPECT_EQ(n0.pci_path, (Path{"0000:10:01.0", "0000:16:00.0", "0000:17:00.0"}));
  EXPECT_EQ(n0.numa_node, 0);
  EXPECT_EQ(n0.error, "");
  ASSERT_EQ(n0.ports.size(), 1u);
  EXPECT_EQ(n0.ports[0].port, 1u);
  EXPECT_TRUE(n0.ports[0].active);
  EXPECT_FALSE(n0.ports[0].ethernet);
  EXPECT_EQ(n0.ports[0].state, "ACTIVE");

  const Nic& n1 = nics_[1];  // the kernel's layout: class link to the device's infiniband dir
  EXPECT_EQ(n1.name, "mlx5_1");
  EXPECT_EQ(n1.pci_path, (Path{"0000:80:01.0", "0000:81:00.0", "0000:82:00.0"}));
  EXPECT_EQ(n1.numa_node, 1);
  ASSERT_EQ(n1.ports.size(), 1u);
  EXPECT_TRUE(n1.ports[0].active);
  EXPECT_TRUE(n1.ports[0].ethernet);

  EXPECT_EQ(nics_[2].name, "mlx5_2");
  EXPECT_EQ(nics_[2].pci_path, (Path{"0000:80:01.0", "0000:81:00.0", "0000:82:00.1"}));

  const Nic& n3 = nics_[3];
  EXPECT_EQ(n3.name, "mlx5_3");
  EXPECT_EQ(n3.pci_path, (Path{"0000:10:02.0", "0000:20:00.0"}));
  EXPECT_EQ(n3.numa_node, -1);  // no numa_node file
  ASSERT_EQ(n3.ports.size(), 2u);
  EXPECT_EQ(n3.ports[0].port, 1u);
  EXPECT_TRUE(n3.ports[0].active);
  EXPECT_EQ(n3.ports[1].port, 2u);
  EXPECT_FALSE(n3.ports[1].active);
  EXPECT_EQ(n3.ports[1].state, "DOWN");

  const Nic& n4 = nics_[4];
  EXPECT_EQ(n4.name, "mlx5_4");
  EXPECT_EQ(n4.numa_node, -1);  // "-1"
  EXPECT_TRUE(n4.ports.empty());
  EXPECT_HAS(n4.error, "cannot list " + sys_.root() + "/class/infiniband/mlx5_4/ports: ");
}

TEST_F(VerbsTopologyTree, DistanceCountsHopsAndPenalizesOtherRootComplexesAndNumaNodes) {
  const Location gpu0{0, "0000:18:00.0"};
  EXPECT_EQ(Distance(nics_[0], gpu0, kGpu0Path), 2);    // same switch
  EXPECT_EQ(Distance(nics_[3], gpu0, kGpu0Path), 5);    // same root bus, other root port
  EXPECT_EQ(Distance(nics_[1], gpu0, kGpu0Path), 206);  // 6 hops, other root complex and node
  const Location gpu1{1, "0000:8a:00.0"};
  EXPECT_EQ(Distance(nics_[3], gpu1, kGpu1Path), 105);  // node of mlx5_3 unknown
  Nic virt;                                             // no PCI path: unknown, as far as can be
  EXPECT_EQ(Distance(virt, gpu1, kGpu1Path), 3 + kOtherRootComplexPenalty);

  EXPECT_EQ(Distance(nics_[0], Location{0, ""}, {}), 0);
  EXPECT_EQ(Distance(nics_[0], Location{1, ""}, {}), kOtherNumaPenalty);
  EXPECT_EQ(Distance(nics_[0], Location{-1, ""}, {}), 0);
  EXPECT_EQ(Distance(nics_[3], Location{1, ""}, {}), 0);
}

TEST_F(VerbsTopologyTree, TheNicUnderTheGpusSwitchComesFirstThenTheNextDistances) {
  const Location gpu0{0, "0000:18:00.0"};
  EXPECT_EQ(Choose(gpu0, kGpu0Path, 1), "mlx5_0:1@2");
  // mlx5_3's DOWN port 2 is never a rail.
  EXPECT_EQ(Choose(gpu0, kGpu0Path, 0), "mlx5_0:1@2, mlx5_3:1@5, mlx5_1:1@206, mlx5_2:1@206");
  EXPECT_EQ(Choose(gpu0, kGpu0Path, 3), "mlx5_0:1@2, mlx5_3:1@5, mlx5_1:1@206");
}

TEST_F(VerbsTopologyTree, TwoNicsEquallyCloseToTheGpuAreBothChosen) {
  auto path = PciPathOf(sys_.root(), "0000:8a:00.0");
  ASSERT_TRUE(path.ok()) << path.status().message();
  EXPECT_EQ(*path, kGpu1Path);
  const Location gpu1{1, "0000:8a:00.0"};
  EXPECT_EQ(Choose(gpu1, *path, 2), "mlx5_1:1@2, mlx5_2:1@2");
  EXPECT_EQ(Choose(gpu1, *path, 0), "mlx5_1:1@2, mlx5_2:1@2, mlx5_3:1@105, mlx5_0:1@206");
}

TEST_F(VerbsTopologyTree, HostMemoryPicksTheNicsOfItsNumaNode) {
  EXPECT_EQ(Choose(Location{1, ""}, {}, 1), "mlx5_1:1@0");
  // mlx5_3's node is unknown, so it is not counted as far.
  EXPECT_EQ(Choose(Location{1, ""}, {}, 0), "mlx5_1:1@0, mlx5_2:1@0, mlx5_3:1@0, mlx5_0:1@100");
  EXPECT_EQ(Choose(Location{0, ""}, {}, 2), "mlx5_0:1@0, mlx5_3:1@0");
  EXPECT_EQ(Choose(Location{-1, ""}, {}, 0), "mlx5_0:1@0, mlx5_1:1@0, mlx5_2:1@0, mlx5_3:1@0");
}

TEST_F(VerbsTopologyTree, FailedRailsAreSkipped) {
  const Location gpu1{1, "0000:8a:00.0"};
  EXPECT_EQ(Choose(gpu1, kGpu1Path, 2, {"mlx5_1:1"}), "mlx5_2:1@2, mlx5_3:1@105");
  EXPECT_EQ(Choose(gpu1, kGpu1Path, 0, {"mlx5_1:1", "mlx5_2:1", "mlx5_3:1"}), "mlx5_0:1@206");
  // A key of another port of the device leaves its port 1 alone.
  EXPECT_EQ(Choose(gpu1, kGpu1Path, 1, {"mlx5_1:2"}), "mlx5_1:1@2");
}

TEST_F(VerbsTopologyTree, NoEligiblePortIsUnavailableNamingEachNicAndWhy) {
  auto rails = ChooseRails(nics_, Location{0, "0000:18:00.0"}, kGpu0Path, 0,
                           {"mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"});
  ASSERT_FALSE(rails.ok());
  EXPECT_EQ(rails.status().code(), KVB_ERR_UNAVAILABLE);
  const std::string m = rails.status().message();
  EXPECT_EQ(m.rfind("no RDMA port to use for memory of GPU 0000:18:00.0: ", 0), 0u) << m;
  EXPECT_HAS(m, "mlx5_0: port 1 failed; ");
  EXPECT_HAS(m, "mlx5_1: port 1 failed; ");
  EXPECT_HAS(m, "mlx5_2: port 1 failed; ");
  EXPECT_HAS(m, "mlx5_3: port 1 failed, port 2 DOWN; ");
  EXPECT_HAS(m, "mlx5_4: cannot list " + sys_.root() + "/class/infiniband/mlx5_4/ports: ");

  auto none = ChooseRails({}, Location{1, ""}, {}, 0, {});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(none.status().message(),
            "no RDMA port to use for host memory on NUMA node 1: no RDMA device");

  Nic portless;
  portless.name = "mlx5_9";
  auto no_port = ChooseRails({portless}, Location{}, {}, 0, {});
  ASSERT_FALSE(no_port.ok());
  EXPECT_EQ(no_port.status().message(), "no RDMA port to use for host memory: mlx5_9: no port");
}

TEST(VerbsTopology, RailsAreOrderedByDeviceNameNaturallyThenPort) {
  Nic ten, two;
  ten.name = "mlx5_10";
  ten.ports = {NicPort{2, true, false, "ACTIVE"}, NicPort{1, true, false, "ACTIVE"}};
  two.name = "mlx5_2";
  two.ports = {NicPort{1, true, false, "ACTIVE"}};
  auto rails = ChooseRails({ten, two}, Location{}, {}, 0, {});
  ASSERT_TRUE(rails.ok()) << rails.status().message();
  ASSERT_EQ(rails->size(), 3u);
  EXPECT_EQ((*rails)[0].device, "mlx5_2");
  EXPECT_EQ((*rails)[1].device, "mlx5_10");
  EXPECT_EQ((*rails)[1].port, 1u);
  EXPECT_EQ((*rails)[2].device, "mlx5_10");
  EXPECT_EQ((*rails)[2].port, 2u);
}

TEST(VerbsTopology, AMissingInfinibandClassIsNoNic) {
  FakeSysfs sys;
  ASSERT_FALSE(sys.root().empty());
  auto nics = ReadNics(sys.root());
  ASSERT_TRUE(nics.ok()) << nics.status().message();
  EXPECT_TRUE(nics->empty());

  sys.Write("class/infiniband", "not a directory");
  auto bad = ReadNics(sys.root());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), KVB_ERR_IO);
  EXPECT_HAS(bad.status().message(), "cannot list " + sys.root() + "/class/infiniband: ");
}

TEST(VerbsTopology, UnreadableDevicesAreKeptWithTheirReason) {
  FakeSysfs sys;
  ASSERT_FALSE(sys.root().empty());
  const std::string pci = "pci0000:10/0000:10:01.0/0000:11:00.0";
  sys.PciDevice(pci, "0");
  sys.Link("class/infiniband/dangling/device", "../../../devices/pci0000:10/0000:10:05.0");
  sys.Nic("no_number", pci, {{"ACTIVE", "InfiniBand"}});
  sys.Nic("no_layer", pci, {kActiveIb});
  std::filesystem::remove(sys.root() + "/class/infiniband/no_layer/ports/1/link_layer");
  sys.PciDevice("pci0000:10/0000:10:02.0/0000:12:00.0", "zero");
  sys.Nic("bad_numa", "pci0000:10/0000:10:02.0/0000:12:00.0", {kActiveIb});
  sys.Ports("class/infiniband/rxe0", {kActiveEth});  // software RoCE: no `device` link

  auto nics = ReadNics(sys.root());
  ASSERT_TRUE(nics.ok()) << nics.status().message();
  ASSERT_EQ(nics->size(), 5u);
  const std::string cls = sys.root() + "/class/infiniband/";
  EXPECT_EQ((*nics)[0].name, "bad_numa");
  EXPECT_EQ((*nics)[0].error, cls + "bad_numa/device/numa_node: 'zero' is not a NUMA node");
  EXPECT_EQ((*nics)[1].name, "dangling");
  EXPECT_EQ((*nics)[1].error,
            "cannot resolve " + cls + "dangling/device: No such file or directory");
  EXPECT_EQ((*nics)[2].name, "no_layer");
  EXPECT_EQ((*nics)[2].error,
            "cannot read " + cls + "no_layer/ports/1/link_layer: No such file or directory");
  EXPECT_TRUE((*nics)[2].ports.empty());
  EXPECT_EQ((*nics)[3].name, "no_number");
  EXPECT_EQ((*nics)[3].error, cls + "no_number/ports/1/state: 'ACTIVE' is not '<number>: <name>'");
  const Nic& rxe = (*nics)[4];
  EXPECT_EQ(rxe.name, "rxe0");
  EXPECT_EQ(rxe.error, "");
  EXPECT_TRUE(rxe.pci_path.empty());
  EXPECT_EQ(rxe.numa_node, -1);
  ASSERT_EQ(rxe.ports.size(), 1u);
  EXPECT_TRUE(rxe.ports[0].ethernet);

  // Only rxe0 is a rail.
  auto rails = ChooseRails(*nics, Location{0, ""}, {}, 0, {});
  ASSERT_TRUE(rails.ok()) << rails.status().message();
  ASSERT_EQ(rails->size(), 1u);
  EXPECT_EQ((*rails)[0].device, "rxe0");
}

TEST_F(VerbsTopologyTree, BusIdsResolveWhateverTheirCase) {
  for (const char* id : {"0000:8A:00.0", "0000:8a:00.0", "00000000:8A:00.0"}) {
    auto path = PciPathOf(sys_.root(), id);
    ASSERT_TRUE(path.ok()) << id << ": " << path.status().message();
    EXPECT_EQ(*path, kGpu1Path) << id;
  }
  auto gpu0 = PciPathOf(sys_.root(), "0000:18:00.0");
  ASSERT_TRUE(gpu0.ok()) << gpu0.status().message();
  EXPECT_EQ(*gpu0, kGpu0Path);

  auto missing = PciPathOf(sys_.root(), "0000:99:00.0");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), KVB_ERR_NOT_FOUND);
  EXPECT_HAS(missing.status().message(), sys_.root() + "/bus/pci/devices/0000:99:00.0");
  for (const char* bad : {"gpu0", "", "0000:8a:00", "0000:8g:00.0", "000:8a:00.0"}) {
    auto r = PciPathOf(sys_.root(), bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), KVB_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_HAS(r.status().message(), std::string("'") + bad + "' is not a PCI bus id");
  }
}

// Stripes as "offset+length" lists, for exact comparisons.
std::string Plan(uint64_t length, uint32_t rails, uint64_t min_chunk) {
  std::string s;
  for (const Stripe& st : PlanStripes(length, rails, min_chunk)) {
    s += (s.empty() ? "" : " ") + std::to_string(st.rail) + ":" + std::to_string(st.offset) + "+" +
         std::to_string(st.length);
  }
  return s;
}

TEST(VerbsTopology, StripePlansByExample) {
  EXPECT_EQ(Plan(0, 4, 0), "");
  EXPECT_EQ(Plan(100, 0, 0), "");
  EXPECT_EQ(Plan(1, 4, 0), "0:0+1");
  EXPECT_EQ(Plan(100, 4, 1), "0:0+100");  // under a page: one stripe
  EXPECT_EQ(Plan(4097, 2, 1), "0:0+4096 1:4096+1");
  EXPECT_EQ(Plan(4097, 2, 2), "0:0+4097");
  EXPECT_EQ(Plan(8192, 3, 0), "0:0+4096 1:4096+4096");  // two pages, two stripes
  EXPECT_EQ(Plan(16384, 4, 0), "0:0+4096 1:4096+4096 2:8192+4096 3:12288+4096");
  // 10 pages and 5 bytes over 4: 3, 3, 2 pages, then 2 pages and the 5 bytes.
  EXPECT_EQ(Plan(40965, 4, 0), "0:0+12288 1:12288+12288 2:24576+8192 3:32768+8197");
  // Two stripes would be 4096 + 5904: under min_chunk.
  EXPECT_EQ(Plan(10000, 2, 5000), "0:0+10000");
  EXPECT_EQ(Plan(1 << 20, 3, 65536), "0:0+352256 1:352256+348160 2:700416+348160");
  // min_chunk allows four of eight.
  EXPECT_EQ(Plan(1 << 20, 8, 262144), "0:0+262144 1:262144+262144 2:524288+262144 3:786432+262144");
  EXPECT_EQ(Plan(1 << 20, 1, 0), "0:0+1048576");
}

// The best smallest stripe any plan of `n` page-aligned stripes of `length` can have (0 when
// none can), by trying every page count of the last stripe.
uint64_t BestSmallest(uint64_t length, uint64_t n) {
  const uint64_t pages = length / 4096, tail = length % 4096;
  if (n == 1) return length;
  uint64_t best = 0;
  for (uint64_t last = 0; last + (n - 1) <= pages; ++last) {
    const uint64_t last_len = last * 4096 + tail;
    if (last_len == 0) continue;
    best = std::max(best, std::min(last_len, (pages - last) / (n - 1) * 4096));
  }
  return best;
}

TEST(VerbsTopology, StripesCoverTheLengthAlignedAndNoSmallerThanMinChunk) {
  const std::vector<uint64_t> lengths = {1,
                                         100,
                                         4095,
                                         4096,
                                         4097,
                                         8191,
                                         8192,
                                         8193,
                                         12288 + 5,
                                         65536,
                                         (1 << 20) - 1,
                                         (1 << 20) + 123,
                                         3 * (1 << 20) + 7 * 4096 + 1,
                                         uint64_t{1} << 33};
  const std::vector<uint32_t> rail_counts = {0, 1, 2, 3, 4, 7, 8, 16};
  const std::vector<uint64_t> min_chunks = {0, 1, 4096, 5000, 65536, 1 << 20, uint64_t{1} << 40};
  int plans = 0;
  for (uint64_t length : lengths) {
    for (uint32_t rails : rail_counts) {
      for (uint64_t min_chunk : min_chunks) {
        SCOPED_TRACE(std::to_string(length) + " bytes, " + std::to_string(rails) + " rails, " +
                     "min_chunk " + std::to_string(min_chunk));
        const std::vector<Stripe> stripes = PlanStripes(length, rails, min_chunk);
        if (rails == 0) {
          EXPECT_TRUE(stripes.empty());
          continue;
        }
        ++plans;
        ASSERT_FALSE(stripes.empty());
        ASSERT_LE(stripes.size(), rails);
        ASSERT_LE(stripes.size(), (length + 4095) / 4096);
        uint64_t offset = 0, smallest = UINT64_MAX, largest = 0;
        for (size_t i = 0; i < stripes.size(); ++i) {
          EXPECT_EQ(stripes[i].rail, i);
          EXPECT_EQ(stripes[i].offset, offset);  // no gap, no overlap
          EXPECT_EQ(stripes[i].offset % 4096, 0u);
          EXPECT_GT(stripes[i].length, 0u);
          offset += stripes[i].length;
          smallest = std::min(smallest, stripes[i].length);
          largest = std::max(largest, stripes[i].length);
        }
        EXPECT_EQ(offset, length);
        EXPECT_LE(largest - smallest, 4096u);
        if (stripes.size() > 1) {
          EXPECT_GE(smallest, std::max<uint64_t>(min_chunk, 1));
        }
        // No more stripes would do: one more would be too many or have one too small.
        const uint64_t more = stripes.size() + 1;
        if (length <= (uint64_t{1} << 22) && more <= rails) {
          EXPECT_LT(BestSmallest(length, more), std::max<uint64_t>(min_chunk, 1));
        }
      }
    }
  }
  EXPECT_EQ(plans, 14 * 7 * 7);
}

}  // namespace
}  // namespace kvbridge::verbs
