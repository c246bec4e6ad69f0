// LoopbackFabric: a test-only VerbsApi (plugins/transport_verbs/verbs_api.h) and Registrar
// factory over which two verbs::Transport instances in one process move bytes. Devices and
// their ports (GIDs, LIDs, states) are made by the test; an RC QP is wired to the QP whose
// number it was given at RTR, and an RDMA WRITE/READ is a memcpy done at post time after the
// local lkey and the remote rkey were checked against the fake MRs of the right device
// (LOC_PROT_ERR / REM_ACCESS_ERR otherwise), as a NIC would. A QP whose remote is gone or not
// connected back, or whose port (either end) is DOWN, completes RETRY_EXC_ERR.
// Faults: FailNextWrs (the next work requests on a device's QPs complete with a chosen error),
// SetPortState, Stall (work requests get no completion until Unstall; an errored QP flushes
// them). Device limits (kLimits, smaller than RcOptions' defaults) are enforced like a NIC's.
// Counters: work requests posted per device; live QPs and MRs per device.
// Also FakeSysfsTree: a sysfs root listing fake devices, each one ACTIVE RoCE port.
// Thread-safety: every VerbsApi call and every test hook takes one mutex.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "verbs_api.h"
#include "verbs_mr_cache.h"

namespace kvbridge::verbs::testing {

class LoopbackFabric final : public VerbsApi {
 public:
  // A device with `ports` ports, all ACTIVE RoCE with MTU 4096 and a GID derived from the name.
  void AddDevice(const std::string& name, uint8_t ports = 1);
  void SetPortState(const std::string& device, uint8_t port, PortState state);
  // The next `count` work requests posted on any QP of `device` complete with `status` (the QP
  // then errs and flushes what it holds, as a NIC does).
  void FailNextWrs(const std::string& device, WcStatus status, int count = 1);
  void Stall();
  void Unstall();
  uint64_t WrsPosted(const std::string& device);
  // QPs of `device` that are not destroyed.
  size_t LiveQps(const std::string& device);
  // MRs of `device` that are registered (not deregistered).
  size_t LiveMrs(const std::string& device);

  std::unique_ptr<Registrar> MakeRegistrar(const std::string& device);

  // ---- VerbsApi ----
  plugin::sdk::Result<DeviceHandle> OpenDevice(const std::string& name) override;
  plugin::sdk::Status CloseDevice(DeviceHandle dev) override;
  plugin::sdk::Result<PdHandle> AllocPd(DeviceHandle dev) override;
  plugin::sdk::Status DeallocPd(PdHandle pd) override;
  plugin::sdk::Result<CqHandle> CreateCq(DeviceHandle dev, uint32_t depth) override;
  plugin::sdk::Status DestroyCq(CqHandle cq) override;
  plugin::sdk::Result<QpHandle> CreateRcQp(PdHandle pd, CqHandle cq, const QpCaps& caps) override;
  plugin::sdk::Status ModifyQpToInit(QpHandle qp, const InitAttr& attr) override;
  plugin::sdk::Status ModifyQpToRtr(QpHandle qp, const RtrAttr& attr) override;
  plugin::sdk::Status ModifyQpToRts(QpHandle qp, const RtsAttr& attr) override;
  plugin::sdk::Status ModifyQpToErr(QpHandle qp) override;
  plugin::sdk::Status DestroyQp(QpHandle qp) override;
  plugin::sdk::Status PostSend(QpHandle qp, std::span<const SendWr> wrs, size_t* accepted) override;
  plugin::sdk::Result<size_t> PollCq(CqHandle cq, std::span<Completion> out) override;
  plugin::sdk::Result<PortAttr> QueryPort(DeviceHandle dev, uint8_t port) override;
  plugin::sdk::Result<Gid> QueryGid(DeviceHandle dev, uint8_t port, int gid_index) override;
  // kLimits; CreateCq, CreateRcQp and the RTR/RTS modifies refuse more, as a NIC does.
  plugin::sdk::Result<DeviceAttr> QueryDevice(DeviceHandle dev) override;
  static constexpr DeviceAttr kLimits{64, 64, 8, 8};

 private:
  enum class QpState { kReset, kInit, kRtr, kRts, kErr };
  struct Device {
    std::string name;
    std::vector<PortAttr> ports;
    std::vector<Gid> gids;
    std::deque<WcStatus> fail_next;
    uint64_t wrs_posted = 0;
  };
  struct Cq {
    std::deque<Completion> queue;
  };
  struct Qp {
    uint32_t qp_num = 0;
    Device* device = nullptr;
    Cq* cq = nullptr;
    QpState state = QpState::kReset;
    uint8_t port = 1;
    uint32_t dest = 0;
    bool destroyed = false;
    std::vector<SendWr> stalled;
  };
  struct Mr {
    Device* device = nullptr;
    uint64_t addr = 0, len = 0;
    bool valid = true;
  };
  class FakeRegistrar;

  Device* Dev(const std::string& name);
  void Execute(Qp& qp, const SendWr& wr);
  void Flush(Qp& qp);
  bool PortUp(const Device& d, uint8_t port) const;
  const Mr* FindMr(uint32_t key, const Device* device, uint64_t addr, uint64_t len) const;

  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Device>> devices_;
  std::vector<std::unique_ptr<Cq>> cqs_;
  std::map<uint32_t, std::unique_ptr<Qp>> qps_;
  std::map<uint32_t, Mr> mrs_;
  uint32_t next_qp_ = 0x100;
  uint32_t next_key_ = 0x1000;
  bool stalled_ = false;
};

// A sysfs root in a fresh temp directory (removed with the object) listing `devices`, each with
// one ACTIVE Ethernet port on PCI and its NUMA node.
class FakeSysfsTree {
 public:
  // numa_nodes[i] is device i's NUMA node (0 when not given).
  explicit FakeSysfsTree(const std::vector<std::string>& devices,
                         const std::vector<int>& numa_nodes = {});
  ~FakeSysfsTree();
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

}  // namespace kvbridge::verbs::testing
