// libkvb_transport_sdk_echo.so: the smallest transport on the plugin SDK that a host can load,
// built as its own module so SdkTransportPlugin.LoadsThroughTheRegistry checks what
// KVB_TRANSPORT_PLUGIN exports. It moves no bytes: every post fails UNSUPPORTED.
#include <memory>
#include <span>
#include <string>

#include "kvbridge/plugin/sdk/transport.hpp"

namespace {

namespace sdk = kvbridge::plugin::sdk;

class EchoTransport {
 public:
  static constexpr const char* kName = "sdk_echo";
  static constexpr const char* kVersion = "0";
  static constexpr uint64_t kCaps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM;
  struct Peer {};
  struct Request {};

  static sdk::Result<std::unique_ptr<EchoTransport>> Create(sdk::Host host,
                                                            const kvb_transport_params_t& p) {
    auto greeting = host.Config<std::string>("sdk_echo.greeting", "hello");
    if (!greeting.ok()) return greeting.status();
    auto t = std::make_unique<EchoTransport>();
    t->endpoint_ = *greeting + ":" + (p.node_id != nullptr ? p.node_id : "");
    return t;
  }
  std::string Endpoints() { return endpoint_; }
  sdk::Status RegisterMemory(const sdk::Region&, sdk::RkeyBuffer&) { return sdk::Status(); }
  sdk::Status DeregisterMemory(uint64_t) { return sdk::Status(); }
  sdk::Result<Peer*> AddPeer(const sdk::PeerInfo&) { return new Peer; }
  sdk::Status UpdatePeer(Peer*, const sdk::PeerInfo&) { return sdk::Status(); }
  void RemovePeer(Peer* p) { delete p; }
  sdk::Result<Request*> Post(Peer*, const sdk::Ops&, const sdk::PostOptions&) {
    return sdk::Status(KVB_ERR_UNSUPPORTED, "sdk_echo moves no bytes");
  }
  sdk::Status Poll(Request*, std::span<kvb_status_t>) { return sdk::Status(); }
  void Cancel(Request*) {}
  void Release(Request* r) { delete r; }
  sdk::Status Stats(kvb_transport_stats_t& s) {
    s.connections_open = 1;
    return sdk::Status();
  }

 private:
  std::string endpoint_;
};

}  // namespace

KVB_TRANSPORT_PLUGIN(EchoTransport)
