#include "tests/common/run_self.h"

#include <errno.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdlib>

namespace kvbridge::testing {

int RunSelf(const char* marker, const std::string& test,
            const std::vector<std::pair<std::string, const char*>>& env, std::string* out) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    setenv(marker, "1", 1);
    for (const auto& [name, value] : env) {
      if (value == nullptr) {
        unsetenv(name.c_str());
      } else {
        setenv(name.c_str(), value, 1);
      }
    }
    const std::string filter = "--gtest_filter=" + test;
    execl("/proc/self/exe", program_invocation_short_name, filter.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  std::array<char, 4096> buf;
  ssize_t n;
  while ((n = read(fds[0], buf.data(), buf.size())) > 0) out->append(buf.data(), n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool IsSelfChild(const char* marker) { return std::getenv(marker) != nullptr; }

}  // namespace kvbridge::testing
