// Store daemons as child processes of a test: `kvbridge master` and `kvbridge node` started
// from this build, and the wait for nodes to become ACTIVE. The daemons inherit the test's
// environment, so KVBRIDGE_* variables set (setenv) before a start apply to them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tests/common/test_util.h"

namespace kvbridge::testing {

// The `kvbridge` binary of this build.
const std::string& KvbridgeBin();

// Starts `kvbridge master --listen <listen> <extra...>` (under `prefix`, as
// ChildProcess::Start: e.g. `ip netns exec NAME`) and waits for its "listening on" line. Null, with
// a test failure quoting what it said instead, if that line does not come.
std::unique_ptr<ChildProcess> StartMaster(const std::string& listen,
                                          const std::vector<std::string>& extra = {},
                                          const std::vector<std::string>& prefix = {});

// Starts `kvbridge node --master <master> --node-id <node_id> <extra...>` (under `prefix`, as
// ChildProcess::Start) and waits for its "serving" line. Null, with a test failure quoting
// what it said instead, otherwise.
std::unique_ptr<ChildProcess> StartNode(const std::string& master, const std::string& node_id,
                                        const std::vector<std::string>& extra = {},
                                        const std::vector<std::string>& prefix = {});

// The nodes the master lists as ACTIVE (asked with `token`); -1 when it does not answer.
int ActiveNodes(const std::string& master, const std::string& token = "");

// Waits until exactly `n` nodes are ACTIVE. False (with a test failure naming the count seen
// last) after timeout_ms.
bool WaitForActiveNodes(const std::string& master, int n, int timeout_ms = 15000,
                        const std::string& token = "");

}  // namespace kvbridge::testing
