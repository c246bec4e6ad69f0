// The libibverbs implementation of VerbsApi (verbs_api.h): each call is the libibverbs call of
// the same name; each failure is a Status naming that call and what it said (strerror of the
// errno it returned or set). Needs no device to construct; every call needs one to succeed.
// Thread-safety: stateless; see verbs_api.h.
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "verbs_api.h"

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;

// verbs_api.h's enums are libibverbs' value for value.
static_assert(static_cast<int>(WcStatus::kSuccess) == IBV_WC_SUCCESS);
static_assert(static_cast<int>(WcStatus::kWrFlushErr) == IBV_WC_WR_FLUSH_ERR);
static_assert(static_cast<int>(WcStatus::kRemAccessErr) == IBV_WC_REM_ACCESS_ERR);
static_assert(static_cast<int>(WcStatus::kRetryExcErr) == IBV_WC_RETRY_EXC_ERR);
static_assert(static_cast<int>(WcStatus::kGeneralErr) == IBV_WC_GENERAL_ERR);
static_assert(static_cast<int>(WcStatus::kTmRndvIncomplete) == IBV_WC_TM_RNDV_INCOMPLETE);
static_assert(static_cast<int>(PortState::kActive) == IBV_PORT_ACTIVE);
static_assert(static_cast<int>(PortState::kActiveDefer) == IBV_PORT_ACTIVE_DEFER);

// "ibv_modify_qp(RTR) on QP 17: Invalid argument". `err` is an errno value; 0 (a call that
// failed without saying why) reads "failed".
sdk::Status Fail(kvb_status_t code, const std::string& call, int err) {
  return sdk::Status(code, call + ": " + (err != 0 ? std::strerror(err) : "failed"));
}

// The code for a failed call by its errno: ENOMEM/ENOSPC are NO_SPACE, EINVAL INVALID_ARGUMENT,
// EPERM/EACCES PERMISSION_DENIED, ENODEV/ENOSYS/EOPNOTSUPP UNAVAILABLE, the rest IO.
kvb_status_t CodeOf(int err) {
  switch (err) {
    case ENOMEM:
    case ENOSPC:
      return KVB_ERR_NO_SPACE;
    case EINVAL:
      return KVB_ERR_INVALID_ARGUMENT;
    case EPERM:
    case EACCES:
      return KVB_ERR_PERMISSION_DENIED;
    case ENODEV:
    case ENOSYS:
    case EOPNOTSUPP:
      return KVB_ERR_UNAVAILABLE;
    default:
      return KVB_ERR_IO;
  }
}

sdk::Status Errno(const std::string& call, int err) { return Fail(CodeOf(err), call, err); }

std::string OnQp(const char* call, QpHandle qp) {
  return std::string(call) + " on QP " + std::to_string(qp.qp_num);
}

ibv_mtu ToIbvMtu(uint32_t bytes) {
  switch (bytes) {
    case 256:
      return IBV_MTU_256;
    case 512:
      return IBV_MTU_512;
    case 1024:
      return IBV_MTU_1024;
    case 2048:
      return IBV_MTU_2048;
    default:
      return IBV_MTU_4096;
  }
}

uint32_t FromIbvMtu(int mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return 256;
    case IBV_MTU_512:
      return 512;
    case IBV_MTU_1024:
      return 1024;
    case IBV_MTU_2048:
      return 2048;
    case IBV_MTU_4096:
      return 4096;
    default:
      return 0;
  }
}

class IbvApi final : public VerbsApi {
 public:
  sdk::Result<DeviceHandle> OpenDevice(const std::string& name) override {
    int n = 0;
    errno = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr) {
      return Fail(KVB_ERR_UNAVAILABLE, "ibv_get_device_list (opening " + name + ")", errno);
    }
    std::string have;
    ibv_device* found = nullptr;
    for (int i = 0; i < n; ++i) {
      const char* dn = ibv_get_device_name(list[i]);
      if (dn != nullptr && name == dn) found = list[i];
      have += (have.empty() ? "" : ", ") + std::string(dn != nullptr ? dn : "?");
    }
    if (found == nullptr) {
      ibv_free_device_list(list);
      if (n == 0) {
        return sdk::Status(KVB_ERR_UNAVAILABLE,
                           "ibv_get_device_list: no RDMA device (opening " + name + ")");
      }
      return sdk::Status(KVB_ERR_NOT_FOUND, "ibv_open_device: no RDMA device called " + name +
                                                " (have: " + have + ")");
    }
    errno = 0;
    ibv_context* ctx = ibv_open_device(found);
    const int err = errno;
    ibv_free_device_list(list);
    if (ctx == nullptr) return Errno("ibv_open_device(" + name + ")", err);
    return DeviceHandle{ctx};
  }

  sdk::Status CloseDevice(DeviceHandle dev) override {
    errno = 0;
    if (ibv_close_device(Ctx(dev)) != 0) return Errno("ibv_close_device", errno);
    return {};
  }

  sdk::Result<PdHandle> AllocPd(DeviceHandle dev) override {
    errno = 0;
    ibv_pd* pd = ibv_alloc_pd(Ctx(dev));
    if (pd == nullptr) return Errno("ibv_alloc_pd", errno);
    return PdHandle{pd};
  }

  sdk::Status DeallocPd(PdHandle pd) override {
    if (const int rc = ibv_dealloc_pd(static_cast<ibv_pd*>(pd.impl)); rc != 0) {
      return Errno("ibv_dealloc_pd", rc);
    }
    return {};
  }

  sdk::Result<CqHandle> CreateCq(DeviceHandle dev, uint32_t depth) override {
    errno = 0;
    ibv_cq* cq = ibv_create_cq(Ctx(dev), static_cast<int>(depth), nullptr, nullptr, 0);
    if (cq == nullptr) {
      return Errno("ibv_create_cq(depth " + std::to_string(depth) + ")", errno);
    }
    return CqHandle{cq};
  }

  sdk::Status DestroyCq(CqHandle cq) override {
    if (const int rc = ibv_destroy_cq(static_cast<ibv_cq*>(cq.impl)); rc != 0) {
      return Errno("ibv_destroy_cq", rc);
    }
    return {};
  }

  sdk::Result<QpHandle> CreateRcQp(PdHandle pd, CqHandle cq, const QpCaps& caps) override {
    ibv_qp_init_attr attr{};
    attr.send_cq = static_cast<ibv_cq*>(cq.impl);
    attr.recv_cq = static_cast<ibv_cq*>(cq.impl);
    attr.qp_type = IBV_QPT_RC;
    attr.sq_sig_all = 0;
    attr.cap.max_send_wr = caps.max_send_wr;
    attr.cap.max_send_sge = caps.max_send_sge;
    attr.cap.max_recv_wr = 1;
    attr.cap.max_recv_sge = 1;
    errno = 0;
    ibv_qp* qp = ibv_create_qp(static_cast<ibv_pd*>(pd.impl), &attr);
    if (qp == nullptr) {
      return Errno("ibv_create_qp(RC, max_send_wr " + std::to_string(caps.max_send_wr) +
                       ", max_send_sge " + std::to_string(caps.max_send_sge) + ")",
                   errno);
    }
    return QpHandle{qp->qp_num, qp};
  }

  sdk::Status ModifyQpToInit(QpHandle qp, const InitAttr& a) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = a.pkey_index;
    attr.port_num = a.port;
    attr.qp_access_flags = ((a.access & kAccessLocalWrite) ? IBV_ACCESS_LOCAL_WRITE : 0) |
                           ((a.access & kAccessRemoteWrite) ? IBV_ACCESS_REMOTE_WRITE : 0) |
                           ((a.access & kAccessRemoteRead) ? IBV_ACCESS_REMOTE_READ : 0);
    return Modify(qp, "ibv_modify_qp(INIT)", &attr,
                  IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  }

  sdk::Status ModifyQpToRtr(QpHandle qp, const RtrAttr& a) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = ToIbvMtu(a.path_mtu);
    attr.dest_qp_num = a.dest_qp_num;
    attr.rq_psn = a.rq_psn;
    attr.max_dest_rd_atomic = a.max_dest_rd_atomic;
    attr.min_rnr_timer = a.min_rnr_timer;
    attr.ah_attr.port_num = a.path.port;
    attr.ah_attr.sl = a.path.sl;
    attr.ah_attr.src_path_bits = 0;
    attr.ah_attr.dlid = a.path.dlid;
    attr.ah_attr.is_global = a.path.global ? 1 : 0;
    if (a.path.global) {
      std::memcpy(attr.ah_attr.grh.dgid.raw, a.path.dgid.data(), sizeof(attr.ah_attr.grh.dgid));
      attr.ah_attr.grh.sgid_index = a.path.sgid_index;
      attr.ah_attr.grh.hop_limit = a.path.hop_limit;
      attr.ah_attr.grh.traffic_class = a.path.traffic_class;
      attr.ah_attr.grh.flow_label = 0;
    }
    return Modify(qp, "ibv_modify_qp(RTR)", &attr,
                  IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                      IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  }

  sdk::Status ModifyQpToRts(QpHandle qp, const RtsAttr& a) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = a.sq_psn;
    attr.timeout = a.timeout;
    attr.retry_cnt = a.retry_cnt;
    attr.rnr_retry = a.rnr_retry;
    attr.max_rd_atomic = a.max_rd_atomic;
    return Modify(qp, "ibv_modify_qp(RTS)", &attr,
                  IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                      IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  }

  sdk::Status ModifyQpToErr(QpHandle qp) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    return Modify(qp, "ibv_modify_qp(ERR)", &attr, IBV_QP_STATE);
  }

  sdk::Status DestroyQp(QpHandle qp) override {
    if (const int rc = ibv_destroy_qp(static_cast<ibv_qp*>(qp.impl)); rc != 0) {
      return Errno(OnQp("ibv_destroy_qp", qp), rc);
    }
    return {};
  }

  sdk::Status PostSend(QpHandle qp, std::span<const SendWr> wrs, size_t* accepted) override {
    if (accepted != nullptr) *accepted = 0;
    if (wrs.empty()) return {};
    std::vector<ibv_send_wr> chain(wrs.size());
    std::vector<ibv_sge> sges(wrs.size());
    for (size_t i = 0; i < wrs.size(); ++i) {
      const SendWr& w = wrs[i];
      sges[i].addr = w.local_addr;
      sges[i].length = w.length;
      sges[i].lkey = w.lkey;
      ibv_send_wr& wr = chain[i];
      wr.wr_id = w.wr_id;
      wr.next = i + 1 < wrs.size() ? &chain[i + 1] : nullptr;
      wr.sg_list = &sges[i];
      wr.num_sge = 1;
      wr.opcode = w.opcode == WrOpcode::kRdmaRead ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
      wr.send_flags = w.signaled ? IBV_SEND_SIGNALED : 0;
      wr.wr.rdma.remote_addr = w.remote_addr;
      wr.wr.rdma.rkey = w.rkey;
    }
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(static_cast<ibv_qp*>(qp.impl), chain.data(), &bad);
    if (rc == 0) {
      if (accepted != nullptr) *accepted = wrs.size();
      return {};
    }
    const size_t took = bad != nullptr ? static_cast<size_t>(bad - chain.data()) : 0;
    if (accepted != nullptr) *accepted = took < wrs.size() ? took : 0;
    return Errno(OnQp("ibv_post_send", qp) + " (work request " + std::to_string(took) + " of " +
                     std::to_string(wrs.size()) + " refused)",
                 rc);
  }

  sdk::Result<size_t> PollCq(CqHandle cq, std::span<Completion> out) override {
    if (out.empty()) return size_t{0};
    ibv_wc wc[32];
    const int want = static_cast<int>(out.size() < std::size(wc) ? out.size() : std::size(wc));
    const int n = ibv_poll_cq(static_cast<ibv_cq*>(cq.impl), want, wc);
    if (n < 0) {
      return sdk::Status(KVB_ERR_IO, "ibv_poll_cq: failed (returned " + std::to_string(n) + ")");
    }
    for (int i = 0; i < n; ++i) {
      Completion& c = out[static_cast<size_t>(i)];
      c.wr_id = wc[i].wr_id;
      c.status = static_cast<WcStatus>(wc[i].status);
      c.vendor_err = wc[i].vendor_err;
      c.opcode = wc[i].opcode == IBV_WC_RDMA_WRITE  ? WcOpcode::kRdmaWrite
                 : wc[i].opcode == IBV_WC_RDMA_READ ? WcOpcode::kRdmaRead
                                                    : WcOpcode::kOther;
      c.byte_len = wc[i].byte_len;
    }
    return static_cast<size_t>(n);
  }

  sdk::Result<PortAttr> QueryPort(DeviceHandle dev, uint8_t port) override {
    ibv_port_attr pa{};
    if (const int rc = ibv_query_port(Ctx(dev), port, &pa); rc != 0) {
      return Errno("ibv_query_port(port " + std::to_string(port) + ")", rc);
    }
    PortAttr out;
    out.state = static_cast<PortState>(pa.state);
    out.lid = pa.lid;
    out.active_mtu = FromIbvMtu(pa.active_mtu);
    out.ethernet = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
    out.gid_table_len = static_cast<uint32_t>(pa.gid_tbl_len);
    return out;
  }

  sdk::Result<DeviceAttr> QueryDevice(DeviceHandle dev) override {
    ibv_device_attr a{};
    if (const int rc = ibv_query_device(Ctx(dev), &a); rc != 0) {
      return Errno("ibv_query_device", rc);
    }
    DeviceAttr out;
    out.max_qp_wr = static_cast<uint32_t>(a.max_qp_wr);
    out.max_cqe = static_cast<uint32_t>(a.max_cqe);
    out.max_qp_rd_atom = static_cast<uint32_t>(a.max_qp_rd_atom);
    out.max_qp_init_rd_atom = static_cast<uint32_t>(a.max_qp_init_rd_atom);
    return out;
  }

  sdk::Result<Gid> QueryGid(DeviceHandle dev, uint8_t port, int gid_index) override {
    ibv_gid gid{};
    errno = 0;
    if (const int rc = ibv_query_gid(Ctx(dev), port, gid_index, &gid); rc != 0) {
      return Errno("ibv_query_gid(port " + std::to_string(port) + ", index " +
                       std::to_string(gid_index) + ")",
                   errno != 0 ? errno : (rc > 0 ? rc : 0));
    }
    Gid out;
    std::memcpy(out.data(), gid.raw, out.size());
    return out;
  }

 private:
  static ibv_context* Ctx(DeviceHandle dev) { return static_cast<ibv_context*>(dev.impl); }

  // ibv_modify_qp returns an errno value.
  static sdk::Status Modify(QpHandle qp, const char* call, ibv_qp_attr* attr, int mask) {
    if (const int rc = ibv_modify_qp(static_cast<ibv_qp*>(qp.impl), attr, mask); rc != 0) {
      return Errno(OnQp(call, qp), rc);
    }
    return {};
  }
};

}  // namespace

std::unique_ptr<VerbsApi> MakeIbvApi() { return std::make_unique<IbvApi>(); }

}  // namespace kvbridge::verbs
