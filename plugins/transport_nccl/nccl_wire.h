// The NCCL transport's control channel (docs/transports/nccl.md, "Control channel"): its
// endpoints text, its frames, and the blocking socket helpers the connect and accept paths use
// (the progress thread drives established connections non-blocking).
//
// One control connection per (initiator, target) pair, opened by the initiator: TCP, then the
// host's handshake (ABI 1.2 auth_* services, transport name "nccl"), then frames. Every frame
// is a 12-byte header [u32 magic "KVNC"][u16 type][u16 zero][u32 body bytes] and a body whose
// length the type fixes (REFUSE: bounded text). Little-endian.
//   COMM   (initiator -> target) ncclUniqueId[128]: make rank 1 of a new 2-rank communicator
//   REQ    (initiator -> target) u64 op id, u32 opcode, u64 segment, u64 offset, u64 length
//   ACCEPT (target -> initiator) u64 op id: the target queued its ncclRecv/ncclSend; issue yours
//   REFUSE (target -> initiator) u64 op id, i32 status, text: nothing was queued or touched
//   DONE   (target -> initiator) u64 op id, i32 status: the target's side of the op ended
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/plugin/sdk/common.hpp"
#include "nccl_loader.h"

namespace kvbridge::nccl {

// ---- endpoints text: "nccl1;c=<host>:<port>" --------------------------------------------------

struct ControlAddress {
  std::string host;
  uint16_t port = 0;
};
std::string FormatEndpoints(const ControlAddress& a);
// INVALID_ARGUMENT naming the text and what is wrong with it.
sdk::Result<ControlAddress> ParseEndpoints(std::string_view text);
// "host:port" (params.listen's first entry); port 0 allowed.
sdk::Result<ControlAddress> ParseHostPort(std::string_view text);

// ---- frames -------------------------------------------------------------------------------------

inline constexpr uint32_t kFrameMagic = 0x434e564b;  // "KVNC"
inline constexpr size_t kHeaderBytes = 12;
inline constexpr size_t kMaxRefuseText = 512;

enum class FrameType : uint16_t { kComm = 1, kReq = 2, kAccept = 3, kRefuse = 4, kDone = 5 };

struct Frame {
  FrameType type = FrameType::kReq;
  uint64_t op_id = 0;
  uint32_t opcode = 0;
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  int32_t status = 0;
  std::string text;   // REFUSE
  ncclUniqueId id{};  // COMM
};

std::string EncodeFrame(const Frame& f);

// Decodes the frame at the front of `buf`: *used is its byte count, 0 when more bytes are needed.
// PROTOCOL naming what is malformed (bad magic, unknown type, wrong body length, text too long).
sdk::Status DecodeFrame(std::string_view buf, Frame* out, size_t* used);

// ---- blocking socket helpers (deadline: host monotonic ns, through now) ---------------------

using NowFn = uint64_t (*)(void* ctx);

// A TCP connection to `a` (TCP_NODELAY), or PEER_UNREACHABLE naming the address and errno.
sdk::Result<int> ConnectTo(const ControlAddress& a, uint64_t deadline_ns, const sdk::Host& host);
sdk::Status SendAll(int fd, const void* data, size_t len, uint64_t deadline_ns,
                    const sdk::Host& host);
sdk::Status RecvAll(int fd, void* data, size_t len, uint64_t deadline_ns, const sdk::Host& host);

// The host's handshake over `fd` (role KVB_AUTH_CLIENT naming the peer it means to reach, or
// KVB_AUTH_SERVER): OK with the peer's identity, or the handshake's error (STALE_PEER,
// UNAUTHENTICATED, PROTOCOL) or PEER_UNREACHABLE when the socket failed or timed out.
sdk::Result<sdk::AuthSession::Identity> Handshake(const sdk::Host& host, int fd, int32_t role,
                                                  std::string_view node_id, uint64_t incarnation,
                                                  uint64_t deadline_ns);

}  // namespace kvbridge::nccl
