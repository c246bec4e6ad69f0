#include "tests/verbs/loopback_fabric.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>

namespace kvbridge::verbs::testing {

namespace sdk = kvbridge::plugin::sdk;
namespace fs = std::filesystem;

class LoopbackFabric::FakeRegistrar final : public Registrar {
 public:
  FakeRegistrar(LoopbackFabric* f, Device* d) : f_(f), d_(d) {}
  sdk::Result<MrKeys> Register(uint64_t addr, uint64_t len, bool device, int) override {
    if (device) return sdk::Status(KVB_ERR_UNSUPPORTED, "fake fabric: no device memory");
    std::lock_guard<std::mutex> lock(f_->mu_);
    const uint32_t key = f_->next_key_++;
    f_->mrs_[key] = Mr{d_, addr, len, true};
    return MrKeys{key, key, RegPath::kHost, key};
  }
  void Deregister(const MrKeys& keys) override {
    std::lock_guard<std::mutex> lock(f_->mu_);
    f_->mrs_[keys.lkey].valid = false;
  }

 private:
  LoopbackFabric* f_;
  Device* d_;
};

void LoopbackFabric::AddDevice(const std::string& name, uint8_t ports) {
  std::lock_guard<std::mutex> lock(mu_);
  auto d = std::make_unique<Device>();
  d->name = name;
  for (uint8_t p = 1; p <= ports; ++p) {
    PortAttr a;
    a.state = PortState::kActive;
    a.lid = 0;
    a.active_mtu = 4096;
    a.ethernet = true;
    a.gid_table_len = 1;
    d->ports.push_back(a);
    Gid g{};
    g[0] = 0xfe;
    g[1] = 0x80;
    for (size_t i = 0; i < name.size() && i < 12; ++i) g[2 + i] = static_cast<uint8_t>(name[i]);
    g[15] = p;
    d->gids.push_back(g);
  }
  devices_[name] = std::move(d);
}

void LoopbackFabric::SetPortState(const std::string& device, uint8_t port, PortState state) {
  std::lock_guard<std::mutex> lock(mu_);
  devices_.at(device)->ports.at(port - 1).state = state;
}

void LoopbackFabric::FailNextWrs(const std::string& device, WcStatus status, int count) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < count; ++i) devices_.at(device)->fail_next.push_back(status);
}

void LoopbackFabric::Stall() {
  std::lock_guard<std::mutex> lock(mu_);
  stalled_ = true;
}

void LoopbackFabric::Unstall() {
  std::lock_guard<std::mutex> lock(mu_);
  stalled_ = false;
  for (auto& [num, qp] : qps_) {
    std::vector<SendWr> wrs = std::move(qp->stalled);
    qp->stalled.clear();
    for (const SendWr& w : wrs) Execute(*qp, w);
  }
}

uint64_t LoopbackFabric::WrsPosted(const std::string& device) {
  std::lock_guard<std::mutex> lock(mu_);
  return devices_.at(device)->wrs_posted;
}

size_t LoopbackFabric::LiveMrs(const std::string& device) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto& [key, mr] : mrs_) n += mr.device->name == device && mr.valid;
  return n;
}

size_t LoopbackFabric::LiveQps(const std::string& device) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto& [num, qp] : qps_) n += qp->device->name == device && !qp->destroyed;
  return n;
}

std::unique_ptr<Registrar> LoopbackFabric::MakeRegistrar(const std::string& device) {
  std::lock_guard<std::mutex> lock(mu_);
  return std::make_unique<FakeRegistrar>(this, devices_.at(device).get());
}

LoopbackFabric::Device* LoopbackFabric::Dev(const std::string& name) {
  auto it = devices_.find(name);
  return it == devices_.end() ? nullptr : it->second.get();
}

bool LoopbackFabric::PortUp(const Device& d, uint8_t port) const {
  return port >= 1 && port <= d.ports.size() && d.ports[port - 1].state == PortState::kActive;
}

const LoopbackFabric::Mr* LoopbackFabric::FindMr(uint32_t key, const Device* device, uint64_t addr,
                                                 uint64_t len) const {
  auto it = mrs_.find(key);
  if (it == mrs_.end() || !it->second.valid || it->second.device != device) return nullptr;
  const Mr& m = it->second;
  if (addr < m.addr || addr - m.addr > m.len || len > m.len - (addr - m.addr)) return nullptr;
  return &m;
}

void LoopbackFabric::Flush(Qp& qp) {
  for (const SendWr& w : qp.stalled) {
    qp.cq->queue.push_back(Completion{w.wr_id, WcStatus::kWrFlushErr, 0, WcOpcode::kOther, 0});
  }
  qp.stalled.clear();
}

void LoopbackFabric::Execute(Qp& qp, const SendWr& wr) {
  auto complete = [&](WcStatus st) {
    const WcOpcode op =
        wr.opcode == WrOpcode::kRdmaRead ? WcOpcode::kRdmaRead : WcOpcode::kRdmaWrite;
    qp.cq->queue.push_back(Completion{wr.wr_id, st, 0, op, wr.length});
    if (st != WcStatus::kSuccess) {
      qp.state = QpState::kErr;
      Flush(qp);
    }
  };
  if (qp.state != QpState::kRts) return complete(WcStatus::kWrFlushErr);
  if (!qp.device->fail_next.empty()) {
    const WcStatus st = qp.device->fail_next.front();
    qp.device->fail_next.pop_front();
    return complete(st);
  }
  auto rit = qps_.find(qp.dest);
  if (!PortUp(*qp.device, qp.port) || rit == qps_.end() || rit->second->destroyed ||
      (rit->second->state != QpState::kRtr && rit->second->state != QpState::kRts) ||
      rit->second->dest != qp.qp_num || !PortUp(*rit->second->device, rit->second->port)) {
    return complete(WcStatus::kRetryExcErr);
  }
  const Qp& remote = *rit->second;
  if (FindMr(wr.lkey, qp.device, wr.local_addr, wr.length) == nullptr) {
    return complete(WcStatus::kLocProtErr);
  }
  if (FindMr(wr.rkey, remote.device, wr.remote_addr, wr.length) == nullptr) {
    return complete(WcStatus::kRemAccessErr);
  }
  auto* local = reinterpret_cast<void*>(wr.local_addr);
  auto* far = reinterpret_cast<void*>(wr.remote_addr);
  if (wr.opcode == WrOpcode::kRdmaWrite) {
    std::memcpy(far, local, wr.length);
  } else {
    std::memcpy(local, far, wr.length);
  }
  complete(WcStatus::kSuccess);
}

// ---- VerbsApi --------------------------------------------------------------------------------

sdk::Result<DeviceHandle> LoopbackFabric::OpenDevice(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  Device* d = Dev(name);
  if (d == nullptr) return sdk::Status(KVB_ERR_NOT_FOUND, "fake fabric: no device " + name);
  return DeviceHandle{d};
}
sdk::Status LoopbackFabric::CloseDevice(DeviceHandle) { return {}; }
sdk::Result<PdHandle> LoopbackFabric::AllocPd(DeviceHandle dev) { return PdHandle{dev.impl}; }
sdk::Status LoopbackFabric::DeallocPd(PdHandle) { return {}; }

sdk::Result<DeviceAttr> LoopbackFabric::QueryDevice(DeviceHandle) { return kLimits; }

sdk::Result<CqHandle> LoopbackFabric::CreateCq(DeviceHandle, uint32_t depth) {
  if (depth > kLimits.max_cqe) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "ibv_create_cq: depth over max_cqe (fake)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  cqs_.push_back(std::make_unique<Cq>());
  return CqHandle{cqs_.back().get()};
}
sdk::Status LoopbackFabric::DestroyCq(CqHandle) { return {}; }

sdk::Result<QpHandle> LoopbackFabric::CreateRcQp(PdHandle pd, CqHandle cq, const QpCaps& caps) {
  if (caps.max_send_wr > kLimits.max_qp_wr) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "ibv_create_qp: max_send_wr over max_qp_wr (fake)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto qp = std::make_unique<Qp>();
  qp->qp_num = next_qp_++;
  qp->device = static_cast<Device*>(pd.impl);
  qp->cq = static_cast<Cq*>(cq.impl);
  Qp* raw = qp.get();
  qps_[raw->qp_num] = std::move(qp);
  return QpHandle{raw->qp_num, raw};
}

sdk::Status LoopbackFabric::ModifyQpToInit(QpHandle h, const InitAttr& a) {
  std::lock_guard<std::mutex> lock(mu_);
  Qp& qp = *static_cast<Qp*>(h.impl);
  if (qp.state != QpState::kReset) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "fake: not RESET");
  qp.port = a.port;
  qp.state = QpState::kInit;
  return {};
}
sdk::Status LoopbackFabric::ModifyQpToRtr(QpHandle h, const RtrAttr& a) {
  std::lock_guard<std::mutex> lock(mu_);
  Qp& qp = *static_cast<Qp*>(h.impl);
  if (qp.state != QpState::kInit) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "fake: not INIT");
  if (a.max_dest_rd_atomic > kLimits.max_qp_rd_atom) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "ibv_modify_qp(RTR): max_dest_rd_atomic (fake)");
  }
  qp.dest = a.dest_qp_num;
  qp.state = QpState::kRtr;
  return {};
}
sdk::Status LoopbackFabric::ModifyQpToRts(QpHandle h, const RtsAttr& a) {
  std::lock_guard<std::mutex> lock(mu_);
  Qp& qp = *static_cast<Qp*>(h.impl);
  if (qp.state != QpState::kRtr) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "fake: not RTR");
  if (a.max_rd_atomic > kLimits.max_qp_init_rd_atom) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "ibv_modify_qp(RTS): max_rd_atomic (fake)");
  }
  qp.state = QpState::kRts;
  return {};
}
sdk::Status LoopbackFabric::ModifyQpToErr(QpHandle h) {
  std::lock_guard<std::mutex> lock(mu_);
  Qp& qp = *static_cast<Qp*>(h.impl);
  qp.state = QpState::kErr;
  Flush(qp);
  return {};
}
sdk::Status LoopbackFabric::DestroyQp(QpHandle h) {
  std::lock_guard<std::mutex> lock(mu_);
  Qp& qp = *static_cast<Qp*>(h.impl);
  qp.destroyed = true;
  qp.state = QpState::kErr;
  qp.stalled.clear();
  return {};
}

sdk::Status LoopbackFabric::PostSend(QpHandle h, std::span<const SendWr> wrs, size_t* accepted) {
  std::lock_guard<std::mutex> lock(mu_);
  *accepted = 0;
  Qp& qp = *static_cast<Qp*>(h.impl);
  if (qp.state != QpState::kRts) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "ibv_post_send: QP not in RTS (fake)");
  }
  for (const SendWr& w : wrs) {
    ++qp.device->wrs_posted;
    ++*accepted;
    if (stalled_) {
      qp.stalled.push_back(w);
    } else {
      Execute(qp, w);
    }
  }
  return {};
}

sdk::Result<size_t> LoopbackFabric::PollCq(CqHandle h, std::span<Completion> out) {
  std::lock_guard<std::mutex> lock(mu_);
  Cq& cq = *static_cast<Cq*>(h.impl);
  size_t n = 0;
  while (n < out.size() && !cq.queue.empty()) {
    out[n++] = cq.queue.front();
    cq.queue.pop_front();
  }
  return n;
}

sdk::Result<PortAttr> LoopbackFabric::QueryPort(DeviceHandle dev, uint8_t port) {
  std::lock_guard<std::mutex> lock(mu_);
  const Device& d = *static_cast<Device*>(dev.impl);
  if (port < 1 || port > d.ports.size()) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "fake: no port " + std::to_string(port));
  }
  return d.ports[port - 1];
}

sdk::Result<Gid> LoopbackFabric::QueryGid(DeviceHandle dev, uint8_t port, int) {
  std::lock_guard<std::mutex> lock(mu_);
  const Device& d = *static_cast<Device*>(dev.impl);
  if (port < 1 || port > d.gids.size()) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "fake: no port " + std::to_string(port));
  }
  return d.gids[port - 1];
}

// ---- FakeSysfsTree ---------------------------------------------------------------------------

FakeSysfsTree::FakeSysfsTree(const std::vector<std::string>& devices,
                             const std::vector<int>& numa_nodes) {
  std::string tmpl = (fs::temp_directory_path() / "kvb_verbs_sysfs_XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) return;
  root_ = tmpl;
  int slot = 1;
  for (const std::string& name : devices) {
    char pci[32];
    std::snprintf(pci, sizeof(pci), "0000:%02x:00.0", slot++);
    const std::string dev_dir = root_ + "/devices/pci0000:00/" + pci;
    fs::create_directories(dev_dir);
    const size_t i = static_cast<size_t>(slot - 2);
    std::ofstream(dev_dir + "/numa_node") << (i < numa_nodes.size() ? numa_nodes[i] : 0) << "\n";
    const std::string ib = root_ + "/class/infiniband/" + name;
    fs::create_directories(ib + "/ports/1");
    fs::create_directory_symlink("../../../devices/pci0000:00/" + std::string(pci), ib + "/device");
    std::ofstream(ib + "/ports/1/state") << "4: ACTIVE\n";
    std::ofstream(ib + "/ports/1/link_layer") << "Ethernet\n";
  }
}

FakeSysfsTree::~FakeSysfsTree() {
  std::error_code ec;
  if (!root_.empty()) fs::remove_all(root_, ec);
}

}  // namespace kvbridge::verbs::testing
