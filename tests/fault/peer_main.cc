// kvb_test_peer: a storage-less peer process for the multi-process fault tests.
// Registers one region filled with a known pattern, prints "DESC <hex descriptor>", then
// answers line commands on stdin until EOF or QUIT:
//   CRC          -> "CRC <crc32c of the region, hex>"
//   FILL <seed>  -> refills the region, "OK"
//   DESC         -> "DESC <hex>"
//   ADD <hex>    -> AddPeer(descriptor), "OK" or "ERR <status>"
//   WRITE <node> <segment> <len> -> writes the region's first len bytes to offset 0 of the
//                   peer's segment, "OK" or "ERR <status>" (this process as the initiator)
//   READ <node> <segment> <len> -> the same, reading the peer's bytes into the region
//   SUBMIT WRITE|READ <node> <segment> <len> -> submits it and answers "OK" without waiting (a
//                   QUIT then destroys the engine with the batch in flight)
//   CONNS <transport> -> "CONNS <opened> <evicted>": the transport's connections_opened and
//                   connections_evicted
// Flags: --node-id, --listen, --size, --seed, --token; --transport <name>[,<name>...] (default
// tcp; the engine's transports in preference order) and --config <key>=<value>, repeatable
// (EngineOptions::plugin_config, e.g. ucx.same_host=off), so the per-transport suites
// (tests/conformance, tests/fault) start the peer over the transport they test.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <span>
#include <string>

#include "kvbridge/engine.h"
#include "tests/common/test_util.h"
#include "util/checksum.h"

using namespace kvbridge;

int main(int argc, char** argv) {
  EngineOptions opts = EngineOptions::FromEnv();
  opts.transports = {"tcp"};
  size_t size = 64u << 20;
  uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--node-id")
      opts.node_id = v;
    else if (k == "--listen")
      opts.listen = v;
    else if (k == "--size")
      size = std::stoull(v);
    else if (k == "--seed")
      seed = std::stoull(v);
    else if (k == "--token")
      opts.cluster_token = v;
    else if (k == "--transport") {
      opts.transports.clear();
      for (size_t at = 0; at <= v.size();) {
        const size_t comma = std::min(v.find(',', at), v.size());
        if (comma > at) opts.transports.push_back(v.substr(at, comma - at));
        at = comma + 1;
      }
      if (opts.transports.empty()) {
        fprintf(stderr, "kvb_test_peer: --transport '%s' names no transport\n", v.c_str());
        return 2;
      }
    } else if (k == "--config") {
      const size_t eq = v.find('=');
      if (eq == std::string::npos || eq == 0) {
        fprintf(stderr, "kvb_test_peer: --config '%s' is not <key>=<value>\n", v.c_str());
        return 2;
      }
      opts.plugin_config[v.substr(0, eq)] = v.substr(eq + 1);
    } else {
      fprintf(stderr, "kvb_test_peer: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  // The test-only plugins (mock, and the deliberately broken ones) only when asked for.
  if (opts.transports != std::vector<std::string>{"tcp"}) {
    opts.plugin_path = KVBRIDGE_TEST_PLUGIN_BUILD_DIR;
  }
  auto engine = TransferEngine::Create(opts);
  if (!engine.ok()) {
    std::cout << "ERR " << engine.status().ToString() << std::endl;
    return 1;
  }
  testing::Buffer region(size);
  region.Fill(seed);
  auto seg = engine.value()->RegisterMemory(region.data(), region.size());
  if (!seg.ok()) {
    std::cout << "ERR " << seg.status().ToString() << std::endl;
    return 1;
  }
  std::cout << "DESC " << testing::HexEncode(engine.value()->LocalDescriptor()) << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "CRC") {
      char buf[16];
      std::snprintf(buf, sizeof(buf), "%08x", util::Crc32c(region.data(), region.size()));
      std::cout << "CRC " << buf << std::endl;
    } else if (line.rfind("FILL ", 0) == 0) {
      region.Fill(std::stoull(line.substr(5)));
      std::cout << "OK" << std::endl;
    } else if (line == "DESC") {
      std::cout << "DESC " << testing::HexEncode(engine.value()->LocalDescriptor()) << std::endl;
    } else if (line.rfind("ADD ", 0) == 0) {
      auto r = engine.value()->AddPeer(testing::HexDecode(line.substr(4)));
      std::cout << (r.ok() ? std::string("OK") : "ERR " + r.status().ToString()) << std::endl;
    } else if (line.rfind("WRITE ", 0) == 0 || line.rfind("READ ", 0) == 0 ||
               line.rfind("SUBMIT ", 0) == 0) {
      const bool submit = line[0] == 'S';
      if (submit) line = line.substr(7);
      const bool write = line[0] == 'W';
      char node[256] = "";
      unsigned long long segment = 0, len = 0;
      if (std::sscanf(line.c_str() + (write ? 6 : 5), "%255s %llu %llu", node, &segment, &len) !=
              3 ||
          len == 0 || len > region.size()) {
        std::cout << "ERR malformed " << (write ? "WRITE" : "READ") << " ("
                  << (write ? "WRITE" : "READ")
                  << " <node> <segment> <len>, len <= " << region.size() << ")" << std::endl;
        continue;
      }
      const TransferOp op{
          write ? OpCode::kWrite : OpCode::kRead, region.data(), len, node, segment, 0};
      if (submit) {
        auto id = engine.value()->Submit(std::span<const TransferOp>(&op, 1));
        std::cout << (id.ok() ? std::string("OK") : "ERR " + id.status().ToString()) << std::endl;
        continue;
      }
      const Status st = engine.value()->Transfer(std::span<const TransferOp>(&op, 1));
      std::cout << (st.ok() ? std::string("OK") : "ERR " + st.ToString()) << std::endl;
    } else if (line.rfind("CONNS ", 0) == 0) {
      auto st = engine.value()->GetTransportStats(line.substr(6));
      if (st.ok()) {
        std::cout << "CONNS " << st->connections_opened << " " << st->connections_evicted
                  << std::endl;
      } else {
        std::cout << "ERR " << st.status().ToString() << std::endl;
      }
    } else if (line == "QUIT") {
      break;
    } else {
      std::cout << "ERR unknown command" << std::endl;
    }
  }
  // The engine goes before the region: a batch still in flight (SUBMIT) moves bytes into it
  // until the engine's shutdown cancels it.
  engine.value().reset();
  return 0;
}
