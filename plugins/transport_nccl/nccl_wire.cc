#include "nccl_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <vector>

#include "socket_io.h"

namespace kvbridge::nccl {
namespace {

void PutU16(std::string* s, uint16_t v) {
  for (int i = 0; i < 2; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}
void PutU32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}
void PutU64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t Get(std::string_view b, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + i])) << (8 * i);
  return v;
}

// The body length each type must have (REFUSE: at least; its text follows).
size_t BodyBytes(FrameType t) {
  switch (t) {
    case FrameType::kComm:
      return sizeof(ncclUniqueId);
    case FrameType::kReq:
      return 36;
    case FrameType::kAccept:
      return 8;
    case FrameType::kRefuse:
      return 12;
    case FrameType::kDone:
      return 12;
  }
  return 0;
}

sdk::Status Bad(const std::string& what) {
  return sdk::Status(KVB_ERR_PROTOCOL, "nccl: malformed control frame: " + what);
}

constexpr std::string_view kControl = "nccl: control connection";

sdk::Status WaitFd(int fd, short events, uint64_t deadline_ns, const sdk::Host& host) {
  return plugin::WaitFd(host, fd, events, deadline_ns, kControl);
}

}  // namespace

std::string FormatEndpoints(const ControlAddress& a) {
  const bool v6 = a.host.find(':') != std::string::npos;
  return "nccl1;c=" + (v6 ? "[" + a.host + "]" : a.host) + ":" + std::to_string(a.port);
}

sdk::Result<ControlAddress> ParseHostPort(std::string_view text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "nccl: '" + std::string(text) + "' is not host:port");
  }
  const std::string_view port = text.substr(colon + 1);
  unsigned v = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), v);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || v > 65535) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "nccl: '" + std::string(text) + "' has no port in 0..65535 after the ':'");
  }
  std::string_view host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {  // "[::1]:port"
    host = host.substr(1, host.size() - 2);
  }
  return ControlAddress{std::string(host), static_cast<uint16_t>(v)};
}

sdk::Result<ControlAddress> ParseEndpoints(std::string_view text) {
  constexpr std::string_view kPrefix = "nccl1;c=";
  if (text.substr(0, kPrefix.size()) != kPrefix) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "nccl: endpoints '" + std::string(text) + "' do not start with 'nccl1;c='");
  }
  auto a = ParseHostPort(text.substr(kPrefix.size()));
  if (!a.ok()) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "nccl: endpoints '" + std::string(text) + "': " + a.status().message());
  }
  if (a->port == 0) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "nccl: endpoints '" + std::string(text) + "' name port 0");
  }
  return a;
}

std::string EncodeFrame(const Frame& f) {
  std::string s;
  PutU32(&s, kFrameMagic);
  PutU16(&s, static_cast<uint16_t>(f.type));
  PutU16(&s, 0);
  std::string body;
  switch (f.type) {
    case FrameType::kComm:
      body.assign(f.id.internal, sizeof(f.id.internal));
      break;
    case FrameType::kReq:
      PutU64(&body, f.op_id);
      PutU32(&body, f.opcode);
      PutU64(&body, f.segment);
      PutU64(&body, f.offset);
      PutU64(&body, f.length);
      break;
    case FrameType::kAccept:
      PutU64(&body, f.op_id);
      break;
    case FrameType::kRefuse:
      PutU64(&body, f.op_id);
      PutU32(&body, static_cast<uint32_t>(f.status));
      body += f.text.substr(0, kMaxRefuseText);
      break;
    case FrameType::kDone:
      PutU64(&body, f.op_id);
      PutU32(&body, static_cast<uint32_t>(f.status));
      break;
  }
  PutU32(&s, static_cast<uint32_t>(body.size()));
  return s + body;
}

sdk::Status DecodeFrame(std::string_view buf, Frame* out, size_t* used) {
  *used = 0;
  if (buf.size() >= 4 && Get(buf, 0, 4) != kFrameMagic) return Bad("bad magic");
  if (buf.size() < kHeaderBytes) return sdk::Status();
  const uint16_t type = static_cast<uint16_t>(Get(buf, 4, 2));
  if (type < 1 || type > 5) return Bad("unknown type " + std::to_string(type));
  if (Get(buf, 6, 2) != 0) return Bad("reserved header bits set");
  const uint64_t len = Get(buf, 8, 4);
  const auto t = static_cast<FrameType>(type);
  const size_t want = BodyBytes(t);
  if (t == FrameType::kRefuse ? (len < want || len > want + kMaxRefuseText) : len != want) {
    return Bad("type " + std::to_string(type) + " with a body of " + std::to_string(len) +
               " bytes");
  }
  if (buf.size() < kHeaderBytes + len) return sdk::Status();
  const std::string_view b = buf.substr(kHeaderBytes, len);
  Frame f;
  f.type = t;
  switch (t) {
    case FrameType::kComm:
      std::memcpy(f.id.internal, b.data(), sizeof(f.id.internal));
      break;
    case FrameType::kReq:
      f.op_id = Get(b, 0, 8);
      f.opcode = static_cast<uint32_t>(Get(b, 8, 4));
      f.segment = Get(b, 12, 8);
      f.offset = Get(b, 20, 8);
      f.length = Get(b, 28, 8);
      break;
    case FrameType::kAccept:
      f.op_id = Get(b, 0, 8);
      break;
    case FrameType::kRefuse:
    case FrameType::kDone:
      f.op_id = Get(b, 0, 8);
      f.status = static_cast<int32_t>(Get(b, 8, 4));
      f.text.assign(b.substr(12));
      break;
  }
  *out = std::move(f);
  *used = kHeaderBytes + len;
  return sdk::Status();
}

sdk::Result<int> ConnectTo(const ControlAddress& a, uint64_t deadline_ns, const sdk::Host& host) {
  const std::string where = a.host + ":" + std::to_string(a.port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (const int r = getaddrinfo(a.host.c_str(), std::to_string(a.port).c_str(), &hints, &res);
      r != 0 || res == nullptr) {
    return sdk::Status(KVB_ERR_PEER_UNREACHABLE,
                       "nccl: cannot resolve " + where + ": " + gai_strerror(r));
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return sdk::Status(KVB_ERR_PEER_UNREACHABLE, std::string("nccl: socket: ") + strerror(errno));
  }
  int r = connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (r != 0 && errno != EINPROGRESS) {
    const int e = errno;
    close(fd);
    return sdk::Status(KVB_ERR_PEER_UNREACHABLE,
                       "nccl: cannot connect to " + where + ": " + strerror(e));
  }
  if (r != 0) {
    if (sdk::Status st = WaitFd(fd, POLLOUT, deadline_ns, host); !st.ok()) {
      close(fd);
      return sdk::Status(KVB_ERR_PEER_UNREACHABLE, "nccl: connecting to " + where + " timed out");
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      close(fd);
      return sdk::Status(KVB_ERR_PEER_UNREACHABLE,
                         "nccl: cannot connect to " + where + ": " + strerror(err));
    }
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

sdk::Status SendAll(int fd, const void* data, size_t len, uint64_t deadline_ns,
                    const sdk::Host& host) {
  return plugin::SendAll(host, fd, data, len, deadline_ns, kControl);
}

sdk::Status RecvAll(int fd, void* data, size_t len, uint64_t deadline_ns, const sdk::Host& host) {
  return plugin::RecvAll(host, fd, data, len, deadline_ns, kControl);
}

sdk::Result<sdk::AuthSession::Identity> Handshake(const sdk::Host& host, int fd, int32_t role,
                                                  std::string_view node_id, uint64_t incarnation,
                                                  uint64_t deadline_ns) {
  auto session = host.BeginAuth(role, node_id, incarnation);
  if (!session.ok()) return session.status();
  const sdk::Status st =
      plugin::CarryHandshake(host, fd, *session, role == KVB_AUTH_CLIENT, deadline_ns, kControl);
  if (!st.ok()) return st;
  return session->Peer();
}

}  // namespace kvbridge::nccl
