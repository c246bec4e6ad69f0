// example_loopback: a complete kvbridge transport plugin in C++, on the plugin SDK
// (kvbridge/plugin/sdk/transport.hpp). examples/transport_plugin_c/ is the same plugin written
// against the C ABI alone.
//
// It reaches exactly one peer, its own process (same node id and incarnation), and completes
// every request inside Post() with a bounds-checked memmove. Real transports queue the work and
// finish it on their own threads; the rules are the same (transport.h): check every remote access
// against the registered regions, fail a request to the wrong incarnation with STALE_PEER, finish
// every request by its deadline, call on_complete exactly once.
//
// What the SDK does here: KVB_TRANSPORT_PLUGIN writes the descriptor, the ops table and
// kvb_plugin_query; each op runs inside a catch (an exception becomes KVB_ERR_INTERNAL with its
// text); messages of the returned sdk::Status go into the host's err buffers; get_stats points
// to the ABI's UNSUPPORTED stub because the class has no Stats(); sdk::Ops steps through the ops
// by the host's op_size.
//
// Thread-safety: every member may be called concurrently (one mutex guards the regions), except
// the destructor.
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvbridge/plugin/sdk/transport.hpp"

namespace {

namespace sdk = kvbridge::plugin::sdk;

class Loopback {
 public:
  static constexpr const char* kName = "example_loopback";
  static constexpr const char* kVersion = "2.0";
  static constexpr uint64_t kCaps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM;

  struct Peer {
    uint64_t incarnation;
  };
  struct Request {
    kvb_status_t status = KVB_OK;
    std::vector<kvb_status_t> op_status;
  };

  // Nothing to check: runs everywhere. (A plugin needing a device says UNAVAILABLE and why.)
  static sdk::Status Probe() { return sdk::Status(); }

  static sdk::Result<std::unique_ptr<Loopback>> Create(sdk::Host host,
                                                       const kvb_transport_params_t& params) {
    // A configuration key, typed and range-checked; a bad value fails create naming the key.
    auto max_regions = host.Config<uint32_t>("example_loopback.max_regions", 64, 1, 4096);
    if (!max_regions.ok()) return max_regions.status();
    auto t = std::make_unique<Loopback>(host, params, *max_regions);
    host.Log(KVB_LOG_INFO, "ready at %s (up to %u regions)", t->endpoint_.c_str(), *max_regions);
    return t;
  }

  Loopback(sdk::Host host, const kvb_transport_params_t& params, uint32_t max_regions)
      : host_(host),
        endpoint_(std::string("loopback:") + (params.node_id != nullptr ? params.node_id : "")),
        incarnation_(params.incarnation),
        max_regions_(max_regions) {}

  std::string Endpoints() { return endpoint_; }

  sdk::Status RegisterMemory(const sdk::Region& r, sdk::RkeyBuffer&) {  // no remote key needed
    if (r.mem_kind != KVB_MEM_HOST) return sdk::Status(KVB_ERR_UNSUPPORTED, "host memory only");
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.size() >= max_regions_) return sdk::Status(KVB_ERR_NO_SPACE, "too many regions");
    if (!regions_.emplace(r.segment_id, r).second) return sdk::Status(KVB_ERR_ALREADY_EXISTS);
    return sdk::Status();
  }

  sdk::Status DeregisterMemory(uint64_t segment_id) {
    std::lock_guard<std::mutex> lock(mu_);
    return regions_.erase(segment_id) != 0 ? sdk::Status() : sdk::Status(KVB_ERR_NOT_FOUND);
  }

  sdk::Result<Peer*> AddPeer(const sdk::PeerInfo& info) {
    if (info.endpoints != endpoint_) {
      return sdk::Status(KVB_ERR_UNSUPPORTED, "example_loopback reaches only its own process");
    }
    return new Peer{info.incarnation};
  }
  sdk::Status UpdatePeer(Peer*, const sdk::PeerInfo&) { return sdk::Status(); }  // nothing cached
  void RemovePeer(Peer* p) { delete p; }  // requests finish inside Post: none is outstanding

  sdk::Result<Request*> Post(Peer* peer, const sdk::Ops& ops, const sdk::PostOptions& opts) {
    if (ops.empty()) return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "example_loopback: no ops");
    for (const kvb_xfer_op_t& op : ops) {  // a malformed op refuses the request: nothing runs
      if ((op.opcode != KVB_OP_READ && op.opcode != KVB_OP_WRITE) || op.length == 0) {
        return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "example_loopback: bad opcode or zero length");
      }
    }
    auto req = std::make_unique<Request>();
    const uint64_t now = host_.NowNs();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const kvb_xfer_op_t& op : ops) {
        const kvb_status_t st = peer->incarnation != incarnation_ ? KVB_ERR_STALE_PEER
                                : opts.deadline_ns != 0 && now >= opts.deadline_ns
                                    ? KVB_ERR_DEADLINE_EXCEEDED
                                    : RunOp(op);
        req->op_status.push_back(st);
        if (req->status == KVB_OK) req->status = st;
      }
    }
    opts.Complete();
    return req.release();
  }

  sdk::Status Poll(Request* req, std::span<kvb_status_t> op_status) {
    for (size_t i = 0; i < op_status.size() && i < req->op_status.size(); ++i) {
      op_status[i] = req->op_status[i];
    }
    if (req->status == KVB_OK) return sdk::Status();
    return sdk::Status(req->status, "example_loopback: op failed");
  }
  void Cancel(Request*) {}  // already final
  void Release(Request* req) { delete req; }

 private:
  // REQUIRES: mu_ held.
  kvb_status_t RunOp(const kvb_xfer_op_t& op) {
    auto it = regions_.find(op.remote_segment);
    if (it == regions_.end()) return KVB_ERR_NOT_REGISTERED;
    const sdk::Region& remote = it->second;
    if (op.remote_offset > remote.length || op.length > remote.length - op.remote_offset) {
      return KVB_ERR_OUT_OF_BOUNDS;
    }
    uint8_t* at = static_cast<uint8_t*>(remote.addr) + op.remote_offset;
    if (op.opcode == KVB_OP_WRITE) {
      std::memmove(at, op.local_addr, op.length);
    } else {
      std::memmove(op.local_addr, at, op.length);
    }
    return KVB_OK;
  }

  const sdk::Host host_;
  const std::string endpoint_;
  const uint64_t incarnation_;
  const uint32_t max_regions_;
  std::mutex mu_;
  std::unordered_map<uint64_t, sdk::Region> regions_;  // guarded by mu_
};

}  // namespace

KVB_TRANSPORT_PLUGIN(Loopback)
