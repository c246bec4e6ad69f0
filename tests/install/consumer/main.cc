// kvb_install_consumer <prefix> <installed plugin dir> <build plugin dir>: checks, from a program
// that sees only an installed kvbridge (its headers, kvbridge::kvbridge, and the public API
// exported by libkvbridge.so), that
//  1. the libkvbridge.so it runs with is the one under <prefix>;
//  2. that library's default plugin search covers the install's plugin directory
//     (<prefix>/<libdir>/kvbridge/plugins) and not the build tree's: a transport that does not
//     exist makes Create() fail naming the directories searched;
//  3. the example plugin, installed into that directory, is found there without
//     KVBRIDGE_PLUGIN_PATH, and the installed tcp plugin moves bytes between two engines.
// Prints "FAIL: ..." and exits 1 at the first check that does not hold.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/engine.h"

namespace {

int Fail(const std::string& what) {
  std::printf("FAIL: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using kvbridge::EngineOptions;
  using kvbridge::TransferEngine;
  if (argc != 4) {
    return Fail("usage: kvb_install_consumer <prefix> <installed plugin dir> <build plugin dir>");
  }
  const std::string prefix = argv[1];
  const std::string installed_plugins = argv[2];
  const std::string build_plugins = argv[3];
  if (std::getenv("KVBRIDGE_PLUGIN_PATH") != nullptr) {
    return Fail("KVBRIDGE_PLUGIN_PATH is set; the check is about the default search");
  }

  // 1. Which libkvbridge.so this is.
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&kvbridge::StatusCodeName), &info) == 0 ||
      info.dli_fname == nullptr) {
    return Fail("dladdr found no library for kvbridge::StatusCodeName");
  }
  const std::string lib = info.dli_fname;
  if (lib.rfind(prefix + "/", 0) != 0)
    return Fail("runs with " + lib + ", not the one under " + prefix);
  std::printf("libkvbridge: %s\n", lib.c_str());

  // 2. The directories searched by default.
  EngineOptions none;
  none.transports = {"kvb_install_check_absent"};
  auto missing = TransferEngine::Create(none);
  if (missing.ok()) return Fail("Create() with a transport that does not exist succeeded");
  const std::string& msg = missing.status().message();
  std::printf("without such a transport: %s\n", missing.status().ToString().c_str());
  if (msg.find(installed_plugins) == std::string::npos) {
    return Fail("the installed plugin directory " + installed_plugins + " was not searched");
  }
  if (msg.find(build_plugins) != std::string::npos) {
    return Fail("the installed library searched the build tree's plugins " + build_plugins);
  }

  // 3. The example plugin from the install's plugin directory, then bytes over tcp.
  EngineOptions ex;
  ex.transports = {"example_loopback"};
  auto example = TransferEngine::Create(ex);
  if (!example.ok()) return Fail("example_loopback: " + example.status().ToString());
  if ((*example)->transports() != std::vector<std::string>{"example_loopback"}) {
    return Fail("the engine does not use example_loopback");
  }

  EngineOptions tcp;
  tcp.transports = {"tcp"};
  tcp.node_id = "install-a";
  auto a = TransferEngine::Create(tcp);
  tcp.node_id = "install-b";
  auto b = TransferEngine::Create(tcp);
  if (!a.ok() || !b.ok()) return Fail("tcp: " + (a.ok() ? b : a).status().ToString());
  std::vector<unsigned char> src(1 << 16), dst(1 << 16, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 7 + 1);
  auto src_seg = (*a)->RegisterMemory(src.data(), src.size());
  auto dst_seg = (*b)->RegisterMemory(dst.data(), dst.size());
  if (!src_seg.ok() || !dst_seg.ok()) return Fail("RegisterMemory failed");
  auto peer = (*a)->AddPeer((*b)->LocalDescriptor());
  if (!peer.ok()) return Fail("AddPeer: " + peer.status().ToString());
  kvbridge::TransferOp op;
  op.opcode = kvbridge::OpCode::kWrite;
  op.local_addr = src.data();
  op.length = src.size();
  op.peer = peer->node_id;
  op.remote_segment = dst_seg.value();
  kvbridge::Status st = (*a)->Transfer({&op, 1});
  if (!st.ok()) return Fail("tcp write: " + st.ToString());
  if (src != dst) return Fail("tcp write: the bytes that arrived differ");
  std::printf("ok: example_loopback found in %s; %zu bytes written over tcp\n",
              installed_plugins.c_str(), src.size());
  return 0;
}
