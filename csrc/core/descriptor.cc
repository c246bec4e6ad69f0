#include "core/descriptor.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstring>

#include "util/checksum.h"

namespace kvbridge::core {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'B', 'D'};
// Version 2 added each segment's base address; version 3 the host key, each transport's caps,
// each segment's device id and the seal. Versions 1 and 2 still decode (base 0, no host key,
// caps 0, device -1, unsealed).
constexpr uint16_t kVersion = 3;
constexpr uint16_t kFlagSealed = 1;
constexpr size_t kSealBytes = 32;  // HMAC-SHA256

// HMAC-SHA256 of `body` under `token`.
std::string Seal(std::string_view token, std::string_view body) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(body.data()), body.size(), mac, &len);
  return std::string(reinterpret_cast<const char*>(mac), len);
}

class Writer {
 public:
  void Bytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  void U16(uint16_t v) { Bytes(&v, sizeof(v)); }
  void U32(uint32_t v) { Bytes(&v, sizeof(v)); }
  void U64(uint64_t v) { Bytes(&v, sizeof(v)); }
  void I32(int32_t v) { Bytes(&v, sizeof(v)); }
  void Str(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

// Reads little-endian fields (the only byte order kvbridge runs on: x86-64 and aarch64).
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool Bytes(void* p, size_t n) {
    if (in_.size() - pos_ < n) return false;
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool U16(uint16_t* v) { return Bytes(v, sizeof(*v)); }
  bool U32(uint32_t* v) { return Bytes(v, sizeof(*v)); }
  bool U64(uint64_t* v) { return Bytes(v, sizeof(*v)); }
  bool I32(int32_t* v) { return Bytes(v, sizeof(*v)); }
  bool Str(std::string* s, size_t max) {
    uint32_t n = 0;
    if (!U32(&n) || n > max || in_.size() - pos_ < n) return false;
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  size_t remaining() const { return in_.size() - pos_; }

 private:
  std::string_view in_;
  size_t pos_ = 0;
};

Status Malformed(std::string_view what) {
  return Status::InvalidArgument("malformed peer descriptor: " + std::string(what));
}

}  // namespace

std::string EncodeDescriptor(const Descriptor& d, std::string_view cluster_token) {
  Writer w;
  w.Bytes(kMagic, sizeof(kMagic));
  w.U16(kVersion);
  w.U16(cluster_token.empty() ? 0 : kFlagSealed);
  w.Str(d.node_id);
  w.U64(d.incarnation);
  w.Str(d.host_key);
  w.U32(static_cast<uint32_t>(d.transports.size()));
  for (const auto& t : d.transports) {
    w.Str(t.name);
    w.Str(t.endpoints);
    w.U64(t.caps);
  }
  w.U32(static_cast<uint32_t>(d.segments.size()));
  for (const auto& s : d.segments) {
    w.U64(s.id);
    w.U64(s.base);
    w.U64(s.length);
    w.U32(s.mem_kind);
    w.I32(s.device_id);
    w.U32(static_cast<uint32_t>(s.rkeys.size()));
    for (const auto& [name, key] : s.rkeys) {
      w.Str(name);
      w.Str(key);
    }
  }
  if (!cluster_token.empty()) {
    const std::string mac = Seal(cluster_token, w.out());
    w.Bytes(mac.data(), mac.size());
  }
  uint32_t crc = util::Crc32c(w.out().data(), w.out().size());
  w.U32(crc);
  return std::move(w.out());
}

Result<Descriptor> DecodeDescriptor(std::string_view blob, std::string_view cluster_token) {
  if (blob.size() < sizeof(kMagic) + 8) return Malformed("too short");
  uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, blob.data() + blob.size() - 4, 4);
  std::string_view body = blob.substr(0, blob.size() - 4);
  if (std::memcmp(body.data(), kMagic, sizeof(kMagic)) != 0) return Malformed("bad magic");
  if (util::Crc32c(body.data(), body.size()) != stored_crc) return Malformed("checksum mismatch");
  Reader header(body.substr(sizeof(kMagic)));
  uint16_t version = 0, flags = 0;
  if (!header.U16(&version) || !header.U16(&flags)) return Malformed("truncated header");
  if (version < 1 || version > kVersion) {
    return Status::InvalidArgument("peer descriptor version " + std::to_string(version) +
                                   " is not supported (this build reads versions 1 to 3)");
  }
  const bool sealed = version >= 3 && (flags & kFlagSealed) != 0;
  std::string_view seal;
  if (sealed) {
    if (body.size() < sizeof(kMagic) + 4 + kSealBytes) return Malformed("truncated seal");
    seal = body.substr(body.size() - kSealBytes);
    body = body.substr(0, body.size() - kSealBytes);
  }
  Reader r(body.substr(sizeof(kMagic) + 4));
  Descriptor d;
  d.sealed = sealed;
  if (!r.Str(&d.node_id, kMaxDescriptorString) || d.node_id.empty()) {
    return Malformed("bad node id");
  }
  if (!r.U64(&d.incarnation)) return Malformed("truncated incarnation");
  if (version >= 3 && !r.Str(&d.host_key, kMaxDescriptorString)) {
    return Malformed("truncated host key");
  }
  uint32_t n = 0;
  if (!r.U32(&n) || n > kMaxDescriptorTransports) return Malformed("bad transport count");
  d.transports.resize(n);
  for (auto& t : d.transports) {
    if (!r.Str(&t.name, kMaxDescriptorString) || !r.Str(&t.endpoints, kMaxDescriptorString) ||
        (version >= 3 && !r.U64(&t.caps))) {
      return Malformed("truncated transport entry");
    }
  }
  if (!r.U32(&n) || n > kMaxDescriptorSegments) return Malformed("bad segment count");
  d.segments.resize(n);
  for (auto& s : d.segments) {
    uint32_t nkeys = 0;
    if (!r.U64(&s.id) || (version >= 2 && !r.U64(&s.base)) || !r.U64(&s.length) ||
        !r.U32(&s.mem_kind) || (version >= 3 && !r.I32(&s.device_id)) || !r.U32(&nkeys) ||
        nkeys > kMaxDescriptorTransports) {
      return Malformed("truncated segment entry");
    }
    for (uint32_t i = 0; i < nkeys; ++i) {
      std::string name, key;
      if (!r.Str(&name, kMaxDescriptorString) || !r.Str(&key, kMaxDescriptorRkey)) {
        return Malformed("truncated remote key");
      }
      s.rkeys.emplace(std::move(name), std::move(key));
    }
  }
  if (r.remaining() != 0) return Malformed("trailing bytes");
  if (!cluster_token.empty()) {
    if (!sealed) {
      return Status::Unauthenticated(
          "the descriptor of peer " + d.node_id +
          " is not sealed, and this process has a cluster token (was it written by a process "
          "without the token, or by a kvbridge older than descriptor version 3?)");
    }
    const std::string want = Seal(cluster_token, body);
    if (want.size() != seal.size() || CRYPTO_memcmp(want.data(), seal.data(), seal.size()) != 0) {
      return Status::Unauthenticated("the descriptor of peer " + d.node_id +
                                     " is sealed under a different cluster token");
    }
  }
  return d;
}

}  // namespace kvbridge::core
