// kvbridge::verbs::VerbsApi: a thin virtual interface over exactly the libibverbs calls the verbs
// transport's connections make (open a device, PD, CQ, RC QP and its state changes, RDMA
// WRITE/READ posts, CQ polls, port and GID queries), with opaque handles and libibverbs-free
// types, so the connection logic (verbs_qp.h) is tested against a fake that records calls and
// injects faults. MakeIbvApi() (verbs_api_ibv.cc) is the real one. Memory registration is not
// here: MrCache's Registrar (verbs_mr_cache.h) does it.
//
// Conventions: every failure is a Status whose message names the libibverbs call and what it
// said (strerror, or ibv_wc_status_str for completions). Handles are plain values; using one
// after it was destroyed is undefined, as with libibverbs. WcStatus, PortState and the MTU byte
// counts map one to one onto libibverbs' enums (checked at compile time in verbs_api_ibv.cc).
//
// Thread-safety: the real implementation keeps no state of its own, so its calls are as
// thread-safe as libibverbs' (one QP or CQ is used by one thread at a time). A fake decides its
// own rules.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kvbridge/plugin/sdk/common.hpp"

namespace kvbridge::verbs {

// Opaque handles. `impl` is the libibverbs object (ibv_context*, ibv_pd*, ibv_cq*, ibv_qp*) for
// the real implementation, whatever a fake likes otherwise.
struct DeviceHandle {
  void* impl = nullptr;
};
struct PdHandle {
  void* impl = nullptr;
};
struct CqHandle {
  void* impl = nullptr;
};
struct QpHandle {
  uint32_t qp_num = 0;  // the QP number peers address (ibv_qp::qp_num)
  void* impl = nullptr;
};

using Gid = std::array<uint8_t, 16>;

// QP access flags for ModifyQpToInit (IBV_ACCESS_*).
inline constexpr uint32_t kAccessLocalWrite = 1u << 0;
inline constexpr uint32_t kAccessRemoteWrite = 1u << 1;
inline constexpr uint32_t kAccessRemoteRead = 1u << 2;

// Path MTUs are byte counts: 256, 512, 1024, 2048 or 4096 (IBV_MTU_256 ... IBV_MTU_4096).
inline bool ValidMtu(uint32_t mtu) {
  return mtu == 256 || mtu == 512 || mtu == 1024 || mtu == 2048 || mtu == 4096;
}

struct QpCaps {
  uint32_t max_send_wr = 0;   // send queue depth (WRITE and READ work requests)
  uint32_t max_send_sge = 1;  // scatter/gather entries per work request
};

struct InitAttr {
  uint8_t port = 1;  // 1-based
  uint16_t pkey_index = 0;
  uint32_t access = kAccessLocalWrite | kAccessRemoteRead | kAccessRemoteWrite;
};

// Where the remote QP is. InfiniBand within a subnet: `dlid` and no GRH (global false). RoCE
// (and InfiniBand across subnets): global true, `dgid` and the local `sgid_index`.
struct AddressPath {
  uint8_t port = 1;  // the local port
  bool global = false;
  uint16_t dlid = 0;
  Gid dgid{};
  uint8_t sgid_index = 0;
  uint8_t hop_limit = 64;
  uint8_t traffic_class = 0;
  uint8_t sl = 0;  // service level
};

struct RtrAttr {
  uint32_t dest_qp_num = 0;
  uint32_t rq_psn = 0;  // the remote's send PSN (24 bits)
  AddressPath path;
  uint32_t path_mtu = 1024;  // bytes
  uint8_t max_dest_rd_atomic = 16;
  uint8_t min_rnr_timer = 12;
};

struct RtsAttr {
  uint32_t sq_psn = 0;         // 24 bits
  uint8_t timeout = 14;        // local ACK timeout: 4.096 us * 2^timeout
  uint8_t retry_cnt = 7;       // transport retries (0-7)
  uint8_t rnr_retry = 7;       // receiver-not-ready retries (7: infinite)
  uint8_t max_rd_atomic = 16;  // RDMA READs this QP keeps in flight
};

enum class WrOpcode : uint8_t { kRdmaWrite, kRdmaRead };

// One work request with one scatter/gather entry.
struct SendWr {
  WrOpcode opcode = WrOpcode::kRdmaWrite;
  uint64_t local_addr = 0;
  uint32_t lkey = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t length = 0;
  uint64_t wr_id = 0;
  bool signaled = true;  // a completion is generated (IBV_SEND_SIGNALED)
};

// ibv_wc_status, value for value.
enum class WcStatus : uint32_t {
  kSuccess = 0,
  kLocLenErr,
  kLocQpOpErr,
  kLocEecOpErr,
  kLocProtErr,
  kWrFlushErr,
  kMwBindErr,
  kBadRespErr,
  kLocAccessErr,
  kRemInvReqErr,
  kRemAccessErr,
  kRemOpErr,
  kRetryExcErr,
  kRnrRetryExcErr,
  kLocRddViolErr,
  kRemInvRdReqErr,
  kRemAbortErr,
  kInvEecnErr,
  kInvEecStateErr,
  kFatalErr,
  kRespTimeoutErr,
  kGeneralErr,
  kTmErr,
  kTmRndvIncomplete,
};

// What ibv_wc_status_str says for `s` ("remote access error"), "unknown" past the table.
inline const char* WcStatusString(WcStatus s) {
  static constexpr const char* kNames[] = {
      "success",
      "local length error",
      "local QP operation error",
      "local EE context operation error",
      "local protection error",
      "Work Request Flushed Error",
      "memory management operation error",
      "bad response error",
      "local access error",
      "remote invalid request error",
      "remote access error",
      "remote operation error",
      "transport retry counter exceeded",
      "RNR retry counter exceeded",
      "local RDD violation error",
      "remote invalid RD request",
      "aborted error",
      "invalid EE context number",
      "invalid EE context state",
      "fatal error",
      "response timeout error",
      "general error",
      "TM error",
      "TM software rendezvous",
  };
  const auto i = static_cast<uint32_t>(s);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

// ibv_wc_opcode for the completions this transport sees; kOther for the rest. Valid only for a
// successful completion (libibverbs leaves it undefined otherwise).
enum class WcOpcode : uint8_t { kRdmaWrite, kRdmaRead, kOther };

struct Completion {
  uint64_t wr_id = 0;
  WcStatus status = WcStatus::kSuccess;
  uint32_t vendor_err = 0;
  WcOpcode opcode = WcOpcode::kOther;
  uint32_t byte_len = 0;
};

// ibv_port_state, value for value.
enum class PortState : uint8_t { kNop = 0, kDown, kInit, kArmed, kActive, kActiveDefer };

struct PortAttr {
  PortState state = PortState::kNop;
  uint16_t lid = 0;
  uint32_t active_mtu = 0;  // bytes, 0 when libibverbs reports none of 256..4096
  bool ethernet = false;    // link layer Ethernet (RoCE)
  uint32_t gid_table_len = 0;
};

// The device limits the transport sizes its QPs by (ibv_device_attr).
struct DeviceAttr {
  uint32_t max_qp_wr = 0;            // work requests per queue
  uint32_t max_cqe = 0;              // entries per CQ
  uint32_t max_qp_rd_atom = 0;       // RDMA READs a QP answers at once (max_dest_rd_atomic)
  uint32_t max_qp_init_rd_atom = 0;  // RDMA READs a QP keeps in flight (max_rd_atomic)
};

class VerbsApi {
 public:
  virtual ~VerbsApi() = default;

  // ibv_get_device_list + ibv_open_device of the device called `name` ("mlx5_0"). NOT_FOUND
  // naming the devices there are when none has that name; UNAVAILABLE when there is none.
  virtual plugin::sdk::Result<DeviceHandle> OpenDevice(const std::string& name) = 0;
  virtual plugin::sdk::Status CloseDevice(DeviceHandle dev) = 0;  // ibv_close_device

  virtual plugin::sdk::Result<PdHandle> AllocPd(DeviceHandle dev) = 0;  // ibv_alloc_pd
  virtual plugin::sdk::Status DeallocPd(PdHandle pd) = 0;               // ibv_dealloc_pd

  // ibv_create_cq with at least `depth` entries, no completion channel.
  virtual plugin::sdk::Result<CqHandle> CreateCq(DeviceHandle dev, uint32_t depth) = 0;
  virtual plugin::sdk::Status DestroyCq(CqHandle cq) = 0;  // ibv_destroy_cq

  // ibv_create_qp: an RC QP in RESET whose send and receive completions go to `cq`; it posts no
  // receives (one receive entry is asked for, as some providers refuse none). Only work
  // requests posted signaled complete.
  virtual plugin::sdk::Result<QpHandle> CreateRcQp(PdHandle pd, CqHandle cq,
                                                   const QpCaps& caps) = 0;
  // ibv_modify_qp to INIT, RTR, RTS and ERR with the attributes an RC QP needs at each.
  virtual plugin::sdk::Status ModifyQpToInit(QpHandle qp, const InitAttr& attr) = 0;
  virtual plugin::sdk::Status ModifyQpToRtr(QpHandle qp, const RtrAttr& attr) = 0;
  virtual plugin::sdk::Status ModifyQpToRts(QpHandle qp, const RtsAttr& attr) = 0;
  virtual plugin::sdk::Status ModifyQpToErr(QpHandle qp) = 0;
  virtual plugin::sdk::Status DestroyQp(QpHandle qp) = 0;  // ibv_destroy_qp

  // ibv_post_send of `wrs` as one chain. *accepted is how many the QP took: all of them on OK;
  // on error those before the one it refused (ibv_post_send's bad_wr), which are posted.
  virtual plugin::sdk::Status PostSend(QpHandle qp, std::span<const SendWr> wrs,
                                       size_t* accepted) = 0;
  // ibv_poll_cq for up to out.size() completions; how many were written to `out` (0: none now).
  virtual plugin::sdk::Result<size_t> PollCq(CqHandle cq, std::span<Completion> out) = 0;

  virtual plugin::sdk::Result<PortAttr> QueryPort(DeviceHandle dev, uint8_t port) = 0;
  virtual plugin::sdk::Result<Gid> QueryGid(DeviceHandle dev, uint8_t port, int gid_index) = 0;
  // ibv_query_device. The default answers UNSUPPORTED (an implementation that cannot tell); the
  // transport then keeps RcOptions' defaults.
  virtual plugin::sdk::Result<DeviceAttr> QueryDevice(DeviceHandle) {
    return plugin::sdk::Status(KVB_ERR_UNSUPPORTED, "QueryDevice is not implemented");
  }
};

// The libibverbs implementation (verbs_api_ibv.cc). Constructing it needs no device.
std::unique_ptr<VerbsApi> MakeIbvApi();

}  // namespace kvbridge::verbs
