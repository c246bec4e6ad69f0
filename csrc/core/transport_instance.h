// TransportInstance: one instance of a transport plugin, and the only code that calls a
// transport's ops table (kvb_transport_ops_t, kvbridge/plugin/transport.h) outside the loader.
//
// It owns the kvb_transport_t (destroy() in the destructor) and the host-services table handed
// to it, turns every ABI status and error buffer into a Status once, and hands out RAII handles:
// a Peer (remove_peer when it dies) and a Request (cancel, if not yet final, then release when it
// dies). A handle that outlives its instance does nothing when it dies (destroy() freed what it
// named); it must not be used meanwhile. The instance holds `library_owner` (the PluginHost), so
// the plugin's library stays mapped while the instance lives.
//
// Thread-safety: as the ABI's: every method may be called concurrently from any thread, except
// that the destructor must not race with anything on the instance. One Request is used by one
// thread at a time (the engine polls a batch under its lock).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/engine.h"
#include "kvbridge/plugin/transport.h"
#include "kvbridge/status.h"

namespace kvbridge::core {

class HostServices;
struct PluginInfo;

struct TransportConfig {
  std::string node_id;
  uint64_t incarnation = 0;
  std::string listen;         // kvb_transport_params_t::listen ("" = the transport's choice)
  std::string cluster_token;  // "" = no authentication
  std::map<std::string, std::string> plugin_config;  // what config_get answers
  // When set, handed to the plugin instead of a HostServices built from plugin_config
  // (borrowed: must outlive the instance). For tests that capture the plugin's log.
  const kvb_host_services_t* services = nullptr;
};

class TransportInstance {
 public:
  class Peer;
  class Request;

  // One remote segment as the peer's descriptor lists it (rkey: what its transport returned).
  struct PeerSegment {
    uint64_t id = 0;
    uint32_t mem_kind = KVB_MEM_HOST;
    uint64_t length = 0;
    std::string_view rkey;
  };
  struct PeerView {
    std::string_view node_id;
    uint64_t incarnation = 0;
    std::string_view endpoints;
    std::span<const PeerSegment> segments;
  };
  struct PostOptions {
    uint64_t deadline_ns = 0;                   // absolute, util::MonoNs; 0 = none
    uint64_t progress_timeout_ns = 0;           // 0 = the transport's default
    void (*on_complete)(void* user) = nullptr;  // see kvb_post_opts_t
    void* user = nullptr;
  };
  struct PollResult {
    bool final = false;
    // IN_PROGRESS until final; then OK or the failed op's error with the plugin's message.
    Status status = Status::InProgress();
    std::vector<kvb_status_t> op_codes;  // one per posted op (IN_PROGRESS while unfinished)
  };

  // Creates an instance of `plugin` (a loaded transport). Errors: the plugin's create() status
  // and message, in context "transport '<name>' (<path>) failed to start".
  static Result<std::unique_ptr<TransportInstance>> Create(
      std::shared_ptr<const void> library_owner, const PluginInfo& plugin,
      const TransportConfig& config);
  ~TransportInstance();
  TransportInstance(const TransportInstance&) = delete;
  TransportInstance& operator=(const TransportInstance&) = delete;

  const std::string& name() const { return name_; }
  // The descriptor's caps, less what the instance dropped (ABI 1.3 instance_caps).
  uint64_t caps() const { return caps_; }
  // The endpoints peers dial (get_endpoints, read once at create).
  const std::string& endpoints() const { return endpoints_; }

  // What register_memory gave: the remote key bytes, and whether peers cannot reach the region
  // over this transport (KVB_REG_LOCAL_ONLY: the key is not to be published).
  struct Registration {
    std::string rkey;
    bool local_only = false;
  };
  // Makes [addr, addr+length) usable under `segment_id` (and reachable, unless local_only).
  Result<Registration> RegisterMemory(uint64_t segment_id, void* addr, uint64_t length,
                                      kvb_mem_kind_t kind, int32_t device_id);
  // NOT_FOUND when the segment is unknown to the transport.
  Status DeregisterMemory(uint64_t segment_id);

  Result<std::unique_ptr<Peer>> AddPeer(const PeerView& peer);
  // Same incarnation, new segments or endpoints; on error the peer keeps its old information.
  Status UpdatePeer(Peer& peer, const PeerView& info);

  // Queues ops to one peer. On error nothing was queued and the Status carries the plugin's
  // message (e.g. BACKPRESSURE, INVALID_ARGUMENT).
  Result<std::unique_ptr<Request>> Post(Peer& peer, std::span<const kvb_xfer_op_t> ops,
                                        const PostOptions& options);
  // Never blocks.
  PollResult Poll(Request& request);
  // Makes the request final (unfinished ops CANCELLED); idempotent.
  void Cancel(Request& request);

  // UNSUPPORTED when the plugin does not declare KVB_TCAP_STATS.
  Result<TransportStats> Stats() const;

  // The plugin's raw instance, for tests that poke a plugin's own exported hooks.
  kvb_transport_t* raw() const { return inst_; }

 private:
  TransportInstance() = default;

  std::shared_ptr<const void> library_owner_;
  std::unique_ptr<HostServices> services_;  // outlives inst_ (destroyed after it)
  // Handles hold it weakly: expired once the instance is gone.
  std::shared_ptr<const bool> alive_ = std::make_shared<const bool>(true);
  const kvb_transport_ops_t* ops_ = nullptr;
  kvb_transport_t* inst_ = nullptr;
  std::string name_;
  uint64_t caps_ = 0;
  std::string endpoints_;
};

// A peer incarnation known to one instance; remove_peer when destroyed (which fails its
// outstanding requests with CANCELLED).
class TransportInstance::Peer {
 public:
  ~Peer();
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  TransportInstance& transport() const { return *transport_; }

 private:
  friend class TransportInstance;
  Peer(TransportInstance* t, kvb_tpeer_t* p) : transport_(t), alive_(t->alive_), peer_(p) {}
  TransportInstance* transport_;
  std::weak_ptr<const bool> alive_;
  kvb_tpeer_t* peer_;
};

// One posted request; when destroyed it is cancelled (unless a Poll saw it final or Cancel was
// called) and released.
class TransportInstance::Request {
 public:
  ~Request();
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  bool final() const { return final_; }
  uint32_t num_ops() const { return num_ops_; }

 private:
  friend class TransportInstance;
  Request(TransportInstance* t, kvb_treq_t* r, uint32_t n)
      : transport_(t), alive_(t->alive_), req_(r), num_ops_(n) {}
  TransportInstance* transport_;
  std::weak_ptr<const bool> alive_;
  kvb_treq_t* req_;
  uint32_t num_ops_;
  bool final_ = false;
};

}  // namespace kvbridge::core
