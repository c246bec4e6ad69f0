#include "verbs_wire.h"

#include <charconv>
#include <cstring>

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;

constexpr std::string_view kMagic = "verbs1";

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}

template <typename T>
bool Number(std::string_view s, T* out) {
  if (s.empty()) return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string GidHex(const Gid& g) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  for (uint8_t b : g) {
    s += kHex[b >> 4];
    s += kHex[b & 15];
  }
  return s;
}

bool ParseGid(std::string_view s, Gid* out) {
  if (s.size() != 32) return false;
  for (size_t i = 0; i < 16; ++i) {
    const int hi = HexDigit(s[2 * i]), lo = HexDigit(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    (*out)[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return true;
}

sdk::Status BadEndpoints(std::string_view text, const std::string& why) {
  return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "verbs: malformed endpoints '" +
                                                   std::string(text.substr(0, 200)) + "': " + why);
}

void PutU32(std::vector<uint8_t>* b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutU64(std::vector<uint8_t>* b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// Reads little-endian values from a byte span; `ok` turns false on the first short read.
class Reader {
 public:
  explicit Reader(sdk::Bytes b) : b_(b) {}
  template <typename T>
  T Get() {
    T v = 0;
    if (pos_ + sizeof(T) > b_.size()) {
      ok_ = false;
      return 0;
    }
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(b_[pos_ + i]) << (8 * i);
    pos_ += sizeof(T);
    return v;
  }
  void Bytes(uint8_t* out, size_t n) {
    if (pos_ + n > b_.size()) {
      ok_ = false;
      return;
    }
    std::memcpy(out, b_.data() + pos_, n);
    pos_ += n;
  }
  bool ok() const { return ok_; }
  size_t left() const { return b_.size() - pos_; }

 private:
  sdk::Bytes b_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace

std::string FormatEndpoints(const Endpoints& e) {
  std::string s(kMagic);
  s += ";cm=" + e.cm_host + ":" + std::to_string(e.cm_port);
  for (const EndpointNic& n : e.nics) {
    s += ";nic=" + n.device + "," + std::to_string(n.port) + "," + std::to_string(n.lid) + "," +
         GidHex(n.gid) + "," + (n.ethernet ? "roce" : "ib") + "," + std::to_string(n.mtu) + "," +
         std::to_string(n.numa_node);
  }
  return s;
}

sdk::Result<Endpoints> ParseEndpoints(std::string_view text) {
  const std::vector<std::string_view> parts = Split(text, ';');
  if (parts[0] != kMagic) return BadEndpoints(text, "does not start with 'verbs1'");
  Endpoints e;
  bool have_cm = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string_view p = parts[i];
    if (p.substr(0, 3) == "cm=") {
      const std::string_view hp = p.substr(3);
      const size_t colon = hp.rfind(':');
      if (colon == std::string_view::npos || colon == 0 ||
          !Number(hp.substr(colon + 1), &e.cm_port) || e.cm_port == 0) {
        return BadEndpoints(text, "cm '" + std::string(hp) + "' is not host:port");
      }
      e.cm_host = std::string(hp.substr(0, colon));
      have_cm = true;
    } else if (p.substr(0, 4) == "nic=") {
      const std::vector<std::string_view> f = Split(p.substr(4), ',');
      EndpointNic n;
      unsigned port = 0;
      if (f.size() != 7) {
        return BadEndpoints(text, "nic '" + std::string(p.substr(4)) + "' has " +
                                      std::to_string(f.size()) + " fields, not 7");
      }
      n.device = std::string(f[0]);
      const char* why = n.device.empty()                                  ? "device name is empty"
                        : !Number(f[1], &port) || port == 0 || port > 255 ? "port is not 1..255"
                        : !Number(f[2], &n.lid)                           ? "lid is not a number"
                        : !ParseGid(f[3], &n.gid)                   ? "gid is not 32 hex digits"
                        : (f[4] != "roce" && f[4] != "ib")          ? "link layer is not roce|ib"
                        : !Number(f[5], &n.mtu) || !ValidMtu(n.mtu) ? "mtu is not 256..4096"
                        : !Number(f[6], &n.numa_node)               ? "numa is not a number"
                                                                    : nullptr;
      if (why != nullptr) {
        return BadEndpoints(text, "nic '" + std::string(p.substr(4)) + "': " + why);
      }
      n.port = static_cast<uint8_t>(port);
      n.ethernet = f[4] == "roce";
      e.nics.push_back(std::move(n));
    } else {
      return BadEndpoints(text, "unknown field '" + std::string(p.substr(0, 40)) + "'");
    }
  }
  if (!have_cm) return BadEndpoints(text, "no cm=<host>:<port>");
  if (e.nics.empty()) return BadEndpoints(text, "no nic=");
  if (e.nics.size() > kMaxNics) {
    return BadEndpoints(
        text, std::to_string(e.nics.size()) + " NICs, at most " + std::to_string(kMaxNics));
  }
  return e;
}

std::vector<uint8_t> EncodeRkeys(const std::vector<RegionKey>& keys) {
  std::vector<uint8_t> b{1, static_cast<uint8_t>(keys.size())};
  for (const RegionKey& k : keys) {
    PutU32(&b, k.rkey);
    PutU64(&b, k.base);
  }
  return b;
}

sdk::Result<std::vector<RegionKey>> DecodeRkeys(sdk::Bytes blob) {
  Reader r(blob);
  const auto version = r.Get<uint8_t>();
  const auto count = r.Get<uint8_t>();
  if (!r.ok() || version != 1 || count == 0 || count > kMaxNics || r.left() != count * 12u) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT,
                       "verbs: malformed rkey blob of " + std::to_string(blob.size()) +
                           " bytes (want [1][count 1..64][count x 12 bytes])");
  }
  std::vector<RegionKey> keys(count);
  for (RegionKey& k : keys) {
    k.rkey = r.Get<uint32_t>();
    k.base = r.Get<uint64_t>();
  }
  return keys;
}

std::vector<uint8_t> EncodeFrame(const Frame& f) {
  std::vector<uint8_t> b(4, 0);
  b.push_back(static_cast<uint8_t>(f.type));
  if (f.type == FrameType::kRefuse) {
    PutU32(&b, static_cast<uint32_t>(f.code));
    const std::string reason = f.reason.substr(0, 1024);
    b.insert(b.end(), reason.begin(), reason.end());
  } else {
    b.push_back(static_cast<uint8_t>(f.qps.size()));
    for (const QpInfo& q : f.qps) {
      b.push_back(q.client_nic);
      b.push_back(q.server_nic);
      PutU32(&b, q.qp_num);
      PutU32(&b, q.psn);
      b.push_back(static_cast<uint8_t>(q.lid));
      b.push_back(static_cast<uint8_t>(q.lid >> 8));
      b.insert(b.end(), q.gid.begin(), q.gid.end());
      PutU32(&b, q.mtu);
    }
  }
  const auto n = static_cast<uint32_t>(b.size() - 4);
  for (int i = 0; i < 4; ++i) b[i] = static_cast<uint8_t>(n >> (8 * i));
  return b;
}

sdk::Result<Frame> DecodeFrame(sdk::Bytes payload) {
  auto bad = [&](const std::string& why) {
    return sdk::Status(KVB_ERR_PROTOCOL, "malformed side-channel frame of " +
                                             std::to_string(payload.size()) + " bytes: " + why);
  };
  if (payload.size() > kMaxFramePayload) return bad("longer than the limit");
  Reader r(payload);
  Frame f;
  const auto type = r.Get<uint8_t>();
  if (!r.ok()) return bad("empty");
  if (type == static_cast<uint8_t>(FrameType::kRefuse)) {
    f.type = FrameType::kRefuse;
    f.code = static_cast<kvb_status_t>(r.Get<uint32_t>());
    if (!r.ok() || f.code <= KVB_IN_PROGRESS || f.code >= KVB_STATUS_CODE_COUNT) {
      return bad("refusal without a valid code");
    }
    f.reason.assign(reinterpret_cast<const char*>(payload.data()) + 5, payload.size() - 5);
    return f;
  }
  if (type != static_cast<uint8_t>(FrameType::kConnect) &&
      type != static_cast<uint8_t>(FrameType::kAccept)) {
    return bad("unknown type " + std::to_string(type));
  }
  f.type = static_cast<FrameType>(type);
  const auto count = r.Get<uint8_t>();
  constexpr size_t kQpInfoBytes = 2 + 4 + 4 + 2 + 16 + 4;
  if (!r.ok() || count == 0 || count > kMaxNics || r.left() != count * kQpInfoBytes) {
    return bad("QP count " + std::to_string(count) + " does not match its length");
  }
  for (uint8_t i = 0; i < count; ++i) {
    QpInfo q;
    q.client_nic = r.Get<uint8_t>();
    q.server_nic = r.Get<uint8_t>();
    q.qp_num = r.Get<uint32_t>();
    q.psn = r.Get<uint32_t>();
    q.lid = r.Get<uint16_t>();
    r.Bytes(q.gid.data(), q.gid.size());
    q.mtu = r.Get<uint32_t>();
    if (q.qp_num == 0 || q.qp_num > 0xffffff || q.psn > 0xffffff || !ValidMtu(q.mtu)) {
      return bad("QP " + std::to_string(i) + " has qp_num " + std::to_string(q.qp_num) + ", psn " +
                 std::to_string(q.psn) + ", mtu " + std::to_string(q.mtu));
    }
    f.qps.push_back(q);
  }
  return f;
}

}  // namespace kvbridge::verbs
