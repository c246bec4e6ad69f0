// RunSelf: runs one test of the running gtest binary again, in a fresh process, for what a
// process loads once (the CUDA driver, NCCL) and a test must see loaded another way. The child
// gets the environment variable `marker` set to "1" (IsSelfChild(marker) says it is one) and the
// changes in `env` (value nullptr: unset). Used by tests/gpu and tests/nccl.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace kvbridge::testing {

// Runs this binary with --gtest_filter=`test`; returns its exit status (0: the test passed, 128+N
// when signal N ended it) and appends its stdout and stderr to *out.
int RunSelf(const char* marker, const std::string& test,
            const std::vector<std::pair<std::string, const char*>>& env, std::string* out);

// True in a child that RunSelf started with this marker.
bool IsSelfChild(const char* marker);

}  // namespace kvbridge::testing
