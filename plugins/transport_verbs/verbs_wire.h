// kvbridge::verbs wire formats: the Endpoints text a verbs instance publishes, the rkey blob
// register_memory returns, and the frames of the connection manager's side channel (the TCP
// exchange of QP infos, docs/transports/verbs.md "Side channel"). Pure functions: every decoder
// refuses malformed input with INVALID_ARGUMENT (Endpoints, rkey) or PROTOCOL (frames) and a
// message naming what is wrong; nothing here touches a socket or a device.
// Thread-safety: every function may be called from any thread; none keeps state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/plugin/sdk/common.hpp"
#include "verbs_api.h"

namespace kvbridge::verbs {

// One NIC port an instance offers, as its Endpoints text lists it.
struct EndpointNic {
  std::string device;  // "mlx5_0"
  uint8_t port = 1;
  uint16_t lid = 0;  // InfiniBand
  Gid gid{};         // RoCE: the GID at verbs.gid_index
  bool ethernet = false;
  uint32_t mtu = 0;  // active MTU, bytes
  int numa_node = -1;
};

struct Endpoints {
  std::string cm_host;  // the side channel ("connection manager")
  uint16_t cm_port = 0;
  std::vector<EndpointNic> nics;  // index = the NIC index rkey blobs and frames use
};

// "verbs1;cm=<host>:<port>;nic=<device>,<port>,<lid>,<gid as 32 hex>,<roce|ib>,<mtu>,<numa>;..."
std::string FormatEndpoints(const Endpoints& e);
plugin::sdk::Result<Endpoints> ParseEndpoints(std::string_view text);

// The rkey of one region on one NIC of the instance that registered it.
struct RegionKey {
  uint32_t rkey = 0;
  uint64_t base = 0;  // the region's address in the registering process
};
inline constexpr size_t kMaxNics = 64;

// [u8 version 1][u8 count] then count x [u32 rkey LE][u64 base LE], one per NIC index.
std::vector<uint8_t> EncodeRkeys(const std::vector<RegionKey>& keys);
plugin::sdk::Result<std::vector<RegionKey>> DecodeRkeys(plugin::sdk::Bytes blob);

// One QP of a (client NIC, server NIC) pair, as the side channel carries it.
struct QpInfo {
  uint8_t client_nic = 0;
  uint8_t server_nic = 0;
  uint32_t qp_num = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  Gid gid{};
  uint32_t mtu = 0;
};

// Side-channel frames: [u32 LE payload length][payload]; payload = [u8 type][...].
enum class FrameType : uint8_t { kConnect = 1, kAccept = 2, kRefuse = 3 };
inline constexpr uint32_t kMaxFramePayload = 8192;

struct Frame {
  FrameType type = FrameType::kConnect;
  std::vector<QpInfo> qps;     // kConnect: the client's QPs; kAccept: the server's, same pairs
  kvb_status_t code = KVB_OK;  // kRefuse
  std::string reason;          // kRefuse
};

// The whole frame, length prefix included.
std::vector<uint8_t> EncodeFrame(const Frame& f);
// The payload (without the length prefix). PROTOCOL naming what is malformed.
plugin::sdk::Result<Frame> DecodeFrame(plugin::sdk::Bytes payload);

}  // namespace kvbridge::verbs
