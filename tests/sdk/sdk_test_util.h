// Helpers for the plugin SDK tests: FakeHost, a full ABI 1.2 kvb_host_services_t whose
// services record what they were asked (log lines, config lookups, the auth_* calls), and
// which can pretend to be an older host by shrinking struct_size.
//
// Thread-safety: none; each test owns its FakeHost.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kvbridge/plugin/abi.h"

// Expects `needle` somewhere in `haystack`, printing the haystack when it is not.
#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

namespace kvbridge::plugin::sdk::testing {

struct LogLine {
  int32_t level;
  std::string plugin;
  std::string msg;
};

class FakeHost {
 public:
  FakeHost() {
    table_ = kvb_host_services_t{
        .struct_size = sizeof(kvb_host_services_t),
        .host_ctx = this,
        .log =
            [](void* ctx, int32_t level, const char* plugin, const char* msg) {
              Self(ctx)->logs.push_back({level, plugin, msg});
            },
        .config_get = [](void* ctx, const char* key, char* buf, uint32_t len) -> int32_t {
          auto& cfg = Self(ctx)->config;
          auto it = cfg.find(key);
          if (it == cfg.end()) return -1;
          if (buf == nullptr || it->second.size() + 1 > len) return -2;
          std::memcpy(buf, it->second.c_str(), it->second.size() + 1);
          return static_cast<int32_t>(it->second.size());
        },
        .now_ns = [](void* ctx) -> uint64_t { return Self(ctx)->now; },
        .node_id = [](void* ctx) { return Self(ctx)->node.c_str(); },
        .incarnation = [](void* ctx) { return Self(ctx)->incarnation; },
        .auth_begin = [](void* ctx, const char* transport, int32_t role, const char* expected,
                         uint64_t expected_inc, kvb_auth_t** out, char* err,
                         uint32_t err_len) -> kvb_status_t {
          FakeHost* h = Self(ctx);
          h->auth_transport = transport;
          h->auth_role = role;
          h->auth_expected = expected != nullptr ? expected : "(null)";
          h->auth_expected_inc = expected_inc;
          if (h->refuse_auth) {
            kvb_copy_message(err, err_len, "no token configured");
            return KVB_ERR_UNAUTHENTICATED;
          }
          *out = reinterpret_cast<kvb_auth_t*>(&h->auth_state);
          return KVB_OK;
        },
        .auth_need = [](void*, kvb_auth_t*, const uint8_t* buf, uint32_t have) -> int32_t {
          if (have == 0) return 1;                  // the first byte is the length
          return buf[0] == 0xff ? -1 : 1 + buf[0];  // 0xff: malformed
        },
        .auth_step = [](void* ctx, kvb_auth_t*, const uint8_t* in, uint32_t in_len, uint8_t* out,
                        uint32_t out_cap, uint32_t* out_len, char* err,
                        uint32_t err_len) -> kvb_status_t {
          FakeHost* h = Self(ctx);
          h->steps_in.emplace_back(in, in + (in == nullptr ? 0 : in_len));
          const std::string reply = "step" + std::to_string(h->steps_in.size());
          if (out_cap < reply.size()) return KVB_ERR_INTERNAL;
          std::memcpy(out, reply.data(), reply.size());
          *out_len = static_cast<uint32_t>(reply.size());
          if (h->steps_in.size() == 3) {
            kvb_copy_message(err, err_len, "peer n2 is incarnation 8, not 7");
            return KVB_ERR_STALE_PEER;
          }
          return h->steps_in.size() == 2 ? KVB_OK : KVB_IN_PROGRESS;
        },
        .auth_peer = [](void*, kvb_auth_t*, char* node, uint32_t cap,
                        uint64_t* inc) -> kvb_status_t {
          kvb_copy_message(node, cap, "n2");
          *inc = 7;
          return KVB_OK;
        },
        .auth_end = [](void* ctx, kvb_auth_t*) { ++Self(ctx)->auth_ends; },
        // No device here: a host without a CUDA driver answers UNAVAILABLE.
        .dev_stream_create = [](void*, int32_t, kvb_dev_stream_t**, char* err,
                                uint32_t err_len) -> kvb_status_t {
          kvb_copy_message(err, err_len, "no CUDA driver (fake host)");
          return KVB_ERR_UNAVAILABLE;
        },
        .dev_stream_destroy = [](void*, kvb_dev_stream_t*) {},
        .dev_copy_async = [](void*, kvb_dev_stream_t*, void*, const void*, uint64_t, uint64_t*,
                             char*, uint32_t) -> kvb_status_t { return KVB_ERR_UNAVAILABLE; },
        .dev_copy_done = [](void*, kvb_dev_stream_t*, uint64_t, char*, uint32_t) -> kvb_status_t {
          return KVB_ERR_UNAVAILABLE;
        },
        .dev_copy_wait = [](void*, kvb_dev_stream_t*, uint64_t, uint64_t, char*,
                            uint32_t) -> kvb_status_t { return KVB_ERR_UNAVAILABLE; },
        .pinned_alloc = [](void*, uint64_t, void** out) -> kvb_status_t {
          *out = nullptr;
          return KVB_ERR_UNAVAILABLE;
        },
        .pinned_free = [](void*, void*) {},
    };
  }
  FakeHost(const FakeHost&) = delete;
  FakeHost& operator=(const FakeHost&) = delete;

  const kvb_host_services_t* table() const { return &table_; }
  // Pretends to be a host of ABI 1.0/1.1, whose table ends after now_ns.
  void ShrinkToAbi1_1() {
    table_.struct_size = offsetof(kvb_host_services_t, now_ns) + sizeof(table_.now_ns);
  }
  kvb_host_services_t& mutable_table() { return table_; }

  // Every logged line, joined, for substring checks.
  std::string AllLogs() const {
    std::string out;
    for (const auto& l : logs) out += l.plugin + ": " + l.msg + "\n";
    return out;
  }

  std::map<std::string, std::string> config;
  std::vector<LogLine> logs;
  uint64_t now = 12345;
  std::string node = "n1";
  uint64_t incarnation = 99;
  bool refuse_auth = false;
  std::string auth_transport, auth_expected;
  int32_t auth_role = 0;
  uint64_t auth_expected_inc = 0;
  std::vector<std::vector<uint8_t>> steps_in;
  int auth_ends = 0;

 private:
  static FakeHost* Self(void* ctx) { return static_cast<FakeHost*>(ctx); }

  kvb_host_services_t table_;
  int auth_state = 0;
};

}  // namespace kvbridge::plugin::sdk::testing
