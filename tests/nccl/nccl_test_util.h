// Helpers for the nccl transport tests: a transport instance on the fake NCCL/CUDA
// (fake_nccl.h) with a real core::HostServices (identity, cluster token, the handshake), driven
// through the plugin class the SDK glue calls, as a stand-in for one process.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/host_services.h"
#include "nccl_transport.h"

namespace kvbridge::nccl::test {

struct Outcome {
  kvb_status_t status = KVB_IN_PROGRESS;
  std::string msg;
  std::vector<kvb_status_t> op_status;
  double ms = 0;  // from post to final
};

class Node {
 public:
  struct Options {
    std::string node_id = "node";
    uint64_t incarnation = 1;
    std::string token;
    std::string listen = "127.0.0.1:0";
    std::map<std::string, std::string> config;
  };
  // Create on the fake NCCL/CUDA; *err gets create's message on failure.
  static std::unique_ptr<Node> Make(const Options& o, sdk::Status* err = nullptr);
  static std::unique_ptr<Node> MakeWith(const Options& o, const Nccl* nccl, const CudaOps* cuda,
                                        sdk::Status* err);
  ~Node();

  Transport& t() { return *t_; }
  const Options& options() const { return o_; }
  const kvb_host_services_t* services() const { return host_->table(); }
  bool LogContains(const std::string& needle) const;
  std::string Logs() const;

  // Registers [addr, addr + len) as CUDA memory of `device` (default: nccl.device, 0).
  sdk::Status Register(uint64_t segment, void* addr, uint64_t len, uint32_t mem_kind = KVB_MEM_CUDA,
                       int32_t device = 0);
  // Learns `other` with the segments it registered (or those given).
  Peer* AddPeer(const Node& other, std::vector<std::pair<uint64_t, uint64_t>> segments = {},
                uint64_t incarnation = 0);
  // Posts one op and waits for it to end (or for wait_ms).
  Outcome Run(Peer* peer, uint32_t opcode, uint64_t local_segment, void* local, uint64_t len,
              uint64_t remote_segment, uint64_t remote_offset, uint64_t deadline_ms = 0,
              uint64_t progress_ms = 0, int wait_ms = 10000);
  // Posts one op; the request (release with Finish) or the post's error.
  sdk::Result<RequestHandle*> Post(Peer* peer, uint32_t opcode, uint64_t local_segment, void* local,
                                   uint64_t len, uint64_t remote_segment, uint64_t remote_offset,
                                   uint64_t deadline_ms = 0, uint64_t progress_ms = 0);
  Outcome Wait(RequestHandle* req, int wait_ms = 10000);
  kvb_transport_stats_t Stats();

  uint64_t NowNs() const;

 private:
  Options o_;
  std::unique_ptr<core::HostServices> host_;
  std::unique_ptr<Transport> t_;
  mutable std::mutex mu_;
  std::vector<std::string> logs_;
  std::vector<std::pair<uint64_t, uint64_t>> segments_;  // what Register accepted
};

}  // namespace kvbridge::nccl::test
