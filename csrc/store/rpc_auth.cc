#include "store/rpc_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <charconv>
#include <chrono>
#include <cstring>

#include "util/hex.h"
#include "util/logging.h"

namespace kvbridge::store {

namespace {

constexpr std::string_view kVersion = "v1";
constexpr std::string_view kMacLabel = "kvbridge-rpc-v1";

bool Hmac(const uint8_t* key, size_t key_len, std::string_view msg, uint8_t out[32]) {
  unsigned int n = 0;
  return HMAC(EVP_sha256(), key, static_cast<int>(key_len),
              reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &n) != nullptr &&
         n == 32;
}

std::string MacInput(std::string_view method, uint64_t unix_ms, const AuthNonce& nonce) {
  std::string m;
  m.reserve(kMacLabel.size() + method.size() + 48);
  m.append(kMacLabel);
  m.push_back('\0');
  m.append(method);
  m.push_back('\0');
  m.append(std::to_string(unix_ms));
  m.push_back('\0');
  m.append(reinterpret_cast<const char*>(nonce.data()), nonce.size());
  return m;
}

std::string_view Metadata(const grpc::ServerContext& ctx, const char* header, bool* found) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(header);
  *found = it != md.end();
  if (!*found) return {};
  return std::string_view(it->second.data(), it->second.size());
}

}  // namespace

uint64_t UnixMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

std::string RandomSecret() {
  std::string s(32, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(s.data()), static_cast<int>(s.size())) != 1) {
    return {};
  }
  return s;
}

CallKey::CallKey(std::string_view secret, std::string_view purpose) {
  if (secret.empty()) return;
  set_ = Hmac(reinterpret_cast<const uint8_t*>(secret.data()), secret.size(), purpose, key_.data());
  if (!set_) KVB_LOG(ERROR) << "HMAC-SHA256 failed deriving a control-plane key";
}

std::string CallKey::Proof(std::string_view method, uint64_t unix_ms,
                           const AuthNonce& nonce) const {
  uint8_t mac[32] = {0};
  if (!set_ || !Hmac(key_.data(), key_.size(), MacInput(method, unix_ms, nonce), mac)) return {};
  return std::string(kVersion) + "." + std::to_string(unix_ms) + "." +
         util::HexEncode(
             std::string_view(reinterpret_cast<const char*>(nonce.data()), nonce.size())) +
         "." + util::HexEncode(std::string_view(reinterpret_cast<const char*>(mac), 32));
}

std::string CallKey::Proof(std::string_view method) const {
  AuthNonce nonce{};
  if (RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1) return {};
  return Proof(method, UnixMs(), nonce);
}

bool CallKey::Verify(std::string_view header, std::string_view method, uint64_t* unix_ms,
                     AuthNonce* nonce) const {
  if (!set_) return false;
  // v1.<ms>.<32 hex>.<64 hex>
  const size_t a = header.find('.');
  const size_t b = a == std::string_view::npos ? a : header.find('.', a + 1);
  const size_t c = b == std::string_view::npos ? b : header.find('.', b + 1);
  if (c == std::string_view::npos || header.substr(0, a) != kVersion) return false;
  const std::string_view ms = header.substr(a + 1, b - a - 1);
  const std::string_view nonce_hex = header.substr(b + 1, c - b - 1);
  const std::string_view mac_hex = header.substr(c + 1);
  auto [end, ec] = std::from_chars(ms.data(), ms.data() + ms.size(), *unix_ms);
  if (ms.empty() || ec != std::errc() || end != ms.data() + ms.size()) return false;
  std::string raw_nonce, raw_mac;
  if (!util::HexDecode(nonce_hex, &raw_nonce) || raw_nonce.size() != nonce->size() ||
      !util::HexDecode(mac_hex, &raw_mac) || raw_mac.size() != 32) {
    return false;
  }
  std::memcpy(nonce->data(), raw_nonce.data(), nonce->size());
  uint8_t expected[32] = {0};
  if (!Hmac(key_.data(), key_.size(), MacInput(method, *unix_ms, *nonce), expected)) return false;
  return CRYPTO_memcmp(expected, raw_mac.data(), 32) == 0;
}

size_t ReplayCache::Hash::operator()(const AuthNonce& n) const {
  uint64_t h;
  std::memcpy(&h, n.data(), sizeof(h));  // random bytes: any 8 of them are a good hash
  return static_cast<size_t>(h);
}

bool ReplayCache::Insert(const AuthNonce& nonce, uint64_t now_ms, uint64_t keep_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  while (!order_.empty() && (order_.front().first <= now_ms || order_.size() >= kMaxEntries)) {
    seen_.erase(order_.front().second);
    order_.pop_front();
  }
  if (!seen_.insert(nonce).second) return false;
  order_.emplace_back(now_ms + keep_ms, nonce);
  return true;
}

size_t ReplayCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_.size();
}

RpcAuth::RpcAuth(std::string_view cluster_token, uint32_t skew_ms)
    : key_(cluster_token, kClusterKeyPurpose), skew_ms_(skew_ms == 0 ? 1 : skew_ms) {}

void RpcAuth::Sign(grpc::ClientContext* ctx, std::string_view method) const {
  SignWith(ctx, kAuthHeader, key_, method);
}

void RpcAuth::SignWith(grpc::ClientContext* ctx, const char* header, const CallKey& key,
                       std::string_view method) {
  if (key.empty()) return;
  ctx->AddMetadata(header, key.Proof(method));
}

bool RpcAuth::Fresh(uint64_t unix_ms, const AuthNonce& nonce, std::string* why) {
  const uint64_t now = UnixMs();
  const uint64_t skew = now > unix_ms ? now - unix_ms : unix_ms - now;
  if (skew > skew_ms_) {
    *why = "its proof is " + std::to_string(skew) + " ms " + (now > unix_ms ? "old" : "early") +
           ", outside the " + std::to_string(skew_ms_) +
           " ms window (clocks differ? KVBRIDGE_RPC_AUTH_SKEW_MS)";
    return false;
  }
  if (!replay_.Insert(nonce, now, 2ull * skew_ms_)) {
    *why = "its proof was used before (a replayed call)";
    return false;
  }
  return true;
}

grpc::Status RpcAuth::Check(const grpc::ServerContext& ctx, std::string_view method,
                            std::string_view who) {
  bool found = false;
  const std::string_view header = Metadata(ctx, kAuthHeader, &found);
  if (!enabled() && !found) return grpc::Status::OK;
  return CheckProof(header, found, method, ctx.peer(), who);
}

grpc::Status RpcAuth::CheckProof(std::string_view proof, bool found, std::string_view method,
                                 std::string_view peer, std::string_view who) {
  if (!enabled()) {
    if (found && !told_unneeded_.exchange(true)) {
      KVB_LOG(WARN) << "a caller (" << peer << ") proves a cluster token but this " << who
                    << " has none: its calls are accepted unchecked; set KVBRIDGE_CLUSTER_TOKEN "
                       "here too";
    }
    return grpc::Status::OK;
  }
  std::string why;
  uint64_t unix_ms = 0;
  AuthNonce nonce{};
  if (!found) {
    why = "it carries no cluster-token proof (x-kvb-auth; a caller without the token)";
  } else if (!key_.Verify(proof, method, &unix_ms, &nonce)) {
    why = "its cluster-token proof does not verify (another token, or a proof for another call)";
  } else if (Fresh(unix_ms, nonce, &why)) {
    return grpc::Status::OK;
  }
  WarnRefused(peer, method, who, why);
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      std::string(method) + " refused by the " + std::string(who) + ": " + why);
}

bool RpcAuth::CheckExtra(const grpc::ServerContext& ctx, const char* header, const CallKey& key,
                         std::string_view method, std::string* why) {
  bool found = false;
  const std::string_view value = Metadata(ctx, header, &found);
  uint64_t unix_ms = 0;
  AuthNonce nonce{};
  if (!found || key.empty()) {
    *why = std::string("no ") + header + " proof";
    return false;
  }
  if (!key.Verify(value, method, &unix_ms, &nonce)) {
    *why = std::string("the ") + header + " proof does not verify";
    return false;
  }
  return Fresh(unix_ms, nonce, why);
}

void RpcAuth::WarnRefused(std::string_view peer, std::string_view method, std::string_view who,
                          const std::string& why) {
  // At most one line a second: a scan of the port must not flood the log.
  const int64_t now = static_cast<int64_t>(UnixMs());
  int64_t last = last_warn_ms_.load();
  if (now - last < 1000 || !last_warn_ms_.compare_exchange_strong(last, now)) {
    unwarned_.fetch_add(1);
    return;
  }
  const uint64_t more = unwarned_.exchange(0);
  KVB_LOG(WARN) << "the " << who << " refused " << method << " from " << peer
                << " (UNAUTHENTICATED): " << why
                << (more ? " (and " + std::to_string(more) + " more refused calls)" : "");
}

void RpcAuth::WarnIfDisabled(std::string_view what, std::string_view address) const {
  if (enabled()) return;
  KVB_LOG(WARN) << "SECURITY: no cluster token: the " << what << " on " << address
                << " and its data plane accept unauthenticated callers (anyone who reaches "
                   "the ports can read, write and delete); set KVBRIDGE_CLUSTER_TOKEN "
                   "(docs/security.md)";
}

}  // namespace kvbridge::store
