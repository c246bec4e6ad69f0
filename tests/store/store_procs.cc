#include "tests/store/store_procs.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "kvbridge/store.h"

namespace kvbridge::testing {

const std::string& KvbridgeBin() {
  static const std::string bin = KVBRIDGE_BIN_DIR "/kvbridge";
  return bin;
}

namespace {

// Starts argv and reads its first stdout line, which must contain `ready`.
std::unique_ptr<ChildProcess> StartDaemon(const std::vector<std::string>& argv,
                                          const std::vector<std::string>& prefix,
                                          const std::string& ready, const std::string& what) {
  auto p = ChildProcess::Start(argv, prefix);
  if (!p) {
    ADD_FAILURE() << what << " did not start";
    return nullptr;
  }
  const std::string line = p->ReadLine(20000);
  if (line.find(ready) == std::string::npos) {
    ADD_FAILURE() << what << " said: '" << line << "', not '" << ready << "...'";
    return nullptr;
  }
  return p;
}

}  // namespace

std::unique_ptr<ChildProcess> StartMaster(const std::string& listen,
                                          const std::vector<std::string>& extra,
                                          const std::vector<std::string>& prefix) {
  std::vector<std::string> argv = {KvbridgeBin(), "master", "--listen", listen};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return StartDaemon(argv, prefix, "listening on", "master at " + listen);
}

std::unique_ptr<ChildProcess> StartNode(const std::string& master, const std::string& node_id,
                                        const std::vector<std::string>& extra,
                                        const std::vector<std::string>& prefix) {
  std::vector<std::string> argv = {KvbridgeBin(), "node", "--master", master, "--node-id", node_id};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return StartDaemon(argv, prefix, "serving", "node " + node_id);
}

int ActiveNodes(const std::string& master, const std::string& token) {
  auto st = QueryClusterStatus(master, 3000, token);
  if (!st.ok()) return -1;
  int n = 0;
  for (const auto& node : st->nodes) n += node.state == "ACTIVE";
  return n;
}

bool WaitForActiveNodes(const std::string& master, int n, int timeout_ms,
                        const std::string& token) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  int seen = ActiveNodes(master, token);
  while (seen != n && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    seen = ActiveNodes(master, token);
  }
  if (seen != n) {
    ADD_FAILURE() << "waited " << timeout_ms << " ms for " << n << " ACTIVE node(s) at " << master
                  << "; the master lists " << seen;
  }
  return seen == n;
}

}  // namespace kvbridge::testing
