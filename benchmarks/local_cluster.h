// A local kvbridge store cluster made of real processes (`kvbridge master` + `kvbridge node`s on
// loopback), for the store demo and benchmark; plus the page helpers both use.
//
// Children die with us: each is started with PR_SET_PDEATHSIG(SIGKILL), the LocalCluster
// destructor kills and reaps them, and InstallCleanupOnSignals() kills them on SIGINT/SIGTERM/
// SIGHUP before the process ends. Start the cluster from the main thread (the death signal is
// tied to the thread that forked) and before any other thread exists.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/store.h"

namespace kvbridge::bench {

using Clock = std::chrono::steady_clock;

inline double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// mkdir -p.
inline void MakeDirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') mkdir(path.substr(0, i).c_str(), 0755);
  }
}

// ------------------------------------------------------------------------ child processes

// Pids of live children, for the signal handler (async-signal-safe access only).
inline std::atomic<pid_t> g_child_pids[32];

inline void TrackChild(pid_t pid, bool add) {
  for (auto& slot : g_child_pids) {
    pid_t expected = add ? 0 : pid;
    if (slot.compare_exchange_strong(expected, add ? pid : 0)) return;
  }
}

inline void KillChildrenAndDie(int sig) {
  for (auto& slot : g_child_pids) {
    const pid_t p = slot.load();
    if (p > 0) kill(p, SIGKILL);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

inline void InstallCleanupOnSignals() {
  struct sigaction sa {};
  sa.sa_handler = KillChildrenAndDie;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

// One daemon: stdout on a pipe (for its "ready" line), stderr appended to a log file.
class Daemon {
 public:
  static std::unique_ptr<Daemon> Start(const std::vector<std::string>& argv_in,
                                       const std::string& log_path, std::string* why) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) {
      *why = std::string("pipe: ") + std::strerror(errno);
      return nullptr;
    }
    const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    std::vector<std::string> args = argv_in;
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
      *why = std::string("fork: ") + std::strerror(errno);
      close(out[0]);
      close(out[1]);
      if (log_fd >= 0) close(log_fd);
      return nullptr;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);  // the parent died before prctl took effect
      dup2(out[1], STDOUT_FILENO);
      if (log_fd >= 0) dup2(log_fd, STDERR_FILENO);
      int devnull = open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, STDIN_FILENO);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    if (log_fd >= 0) close(log_fd);
    TrackChild(pid, true);
    auto d = std::unique_ptr<Daemon>(new Daemon());
    d->pid_ = pid;
    d->out_ = out[0];
    return d;
  }

  ~Daemon() {
    Kill();
    if (out_ >= 0) close(out_);
  }
  pid_t pid() const { return pid_; }
  bool alive() const { return pid_ > 0; }

  // The next stdout line, or "" on EOF/timeout.
  std::string ReadLine(int timeout_ms) {
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      const size_t nl = buffered_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return line;
      }
      const int left = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count());
      if (left <= 0) return "";
      pollfd pfd{out_, POLLIN, 0};
      if (poll(&pfd, 1, left) <= 0) return "";
      char buf[4096];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) return "";
      buffered_.append(buf, static_cast<size_t>(n));
    }
  }

  // kill -9 and reap.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    TrackChild(pid_, false);
    pid_ = -1;
  }

 private:
  Daemon() = default;
  pid_t pid_ = -1;
  int out_ = -1;
  std::string buffered_;
};

// ------------------------------------------------------------------------ the cluster

struct ClusterConfig {
  std::string kvbridge_bin;  // path of the `kvbridge` program
  int nodes = 3;
  uint64_t dram_bytes = 256ull << 20;  // per node
  uint32_t node_ttl_ms = 1000;
  uint32_t lease_ms = 2000;
  std::string log_dir;  // daemons' stderr goes to <log_dir>/<name>.log
};

class LocalCluster {
 public:
  // Starts the master on a free loopback port, then the nodes, and waits until every node is
  // ACTIVE. On failure returns false with the reason (the log files say more).
  bool Start(const ClusterConfig& c, std::string* why) {
    config_ = c;
    // Daemons inherit these: short timeouts so a dead or frozen peer shows quickly.
    setenv("KVBRIDGE_PROGRESS_TIMEOUT_MS", "500", 1);
    setenv("KVBRIDGE_DEADLINE_MS", "3000", 0);
    setenv("KVBRIDGE_LOG_LEVEL", "warn", 0);
    // Storage nodes fault their whole DRAM pool in at start, as a production node would, so the
    // first pass over the pool is not slower than the rest (dram.prefault is off by default).
    setenv("KVBRIDGE_DRAM_PREFAULT", "1", 0);
    if (access(c.kvbridge_bin.c_str(), X_OK) != 0) {
      *why = c.kvbridge_bin + " is not an executable (build the kvbridge_cli target)";
      return false;
    }
    MakeDirs(c.log_dir);
    for (int i = 0; i < c.nodes; ++i) std::remove(LogPath("node" + std::to_string(i)).c_str());
    std::remove(LogPath("master").c_str());
    master_ =
        Daemon::Start({c.kvbridge_bin, "master", "--listen", "127.0.0.1:0", "--node-ttl-ms",
                       std::to_string(c.node_ttl_ms), "--lease-ms", std::to_string(c.lease_ms)},
                      LogPath("master"), why);
    if (!master_) return false;
    const std::string line = master_->ReadLine(20000);
    const std::string tag = "listening on ";
    const size_t at = line.find(tag);
    if (at == std::string::npos) {
      *why = "master did not start (said '" + line + "'; see " + LogPath("master") + ")";
      return false;
    }
    // "listening on HOST:PORT[, status page and /metrics on http://...]"
    address_ = line.substr(at + tag.size());
    address_ = address_.substr(0, address_.find(','));
    for (int i = 0; i < c.nodes; ++i) {
      const std::string id = NodeId(i);
      auto node = Daemon::Start(
          {c.kvbridge_bin, "node", "--master", address_, "--node-id", id, "--dram-bytes",
           std::to_string(c.dram_bytes), "--listen", "127.0.0.1:0", "--metrics-listen", "off"},
          LogPath(id), why);
      if (!node) return false;
      const std::string l = node->ReadLine(20000);
      if (l.find("serving") == std::string::npos) {
        *why = id + " did not start (said '" + l + "'; see " + LogPath(id) + ")";
        return false;
      }
      nodes_.push_back(std::move(node));
    }
    if (!WaitForActive(c.nodes, 15000)) {
      *why = "only " + std::to_string(ActiveNodes()) + " of " + std::to_string(c.nodes) +
             " nodes became ACTIVE";
      return false;
    }
    return true;
  }

  ~LocalCluster() { Stop(); }

  // Kills every daemon (nodes first) and reaps them.
  void Stop() {
    for (auto& n : nodes_) {
      if (n) n->Kill();
    }
    if (master_) master_->Kill();
  }

  const std::string& master_address() const { return address_; }
  static std::string NodeId(int i) { return "node" + std::to_string(i); }
  std::string LogPath(const std::string& name) const {
    return config_.log_dir + "/" + name + ".log";
  }
  void KillNode(int i) { nodes_.at(i)->Kill(); }
  // Pids of the daemons still running (for checks that nothing is left behind).
  std::vector<pid_t> Pids() const {
    std::vector<pid_t> p;
    if (master_ && master_->alive()) p.push_back(master_->pid());
    for (const auto& n : nodes_) {
      if (n && n->alive()) p.push_back(n->pid());
    }
    return p;
  }

  int ActiveNodes() const {
    // The daemons' token (inherited from this process's environment), if the cluster has one.
    auto st = QueryClusterStatus(address_, 2000, EngineOptions::FromEnv().cluster_token);
    if (!st.ok()) return -1;
    int n = 0;
    for (const auto& node : st->nodes) n += node.state == "ACTIVE";
    return n;
  }

  bool WaitForActive(int n, int timeout_ms) const {
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (Clock::now() < until) {
      if (ActiveNodes() == n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

 private:
  ClusterConfig config_;
  std::string address_;
  std::unique_ptr<Daemon> master_;
  std::vector<std::unique_ptr<Daemon>> nodes_;
};

// ------------------------------------------------------------------------ pages and memory

// Page-aligned memory, touched so that first-use faults stay out of the measurements.
struct Arena {
  explicit Arena(size_t n) : size(n) {
    data = static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
    if (!data) std::abort();
    std::memset(data, 0, n);
  }
  ~Arena() { std::free(data); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  uint8_t* data = nullptr;
  size_t size = 0;
};

inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// The i-th 8-byte word of the page whose key hashes to h (cheap, depends on both).
inline uint64_t PageWord(uint64_t h, uint64_t i) {
  return (h ^ (i * 0x9E3779B97F4A7C15ull)) * 0xD6E8FEB86659FD93ull;
}

// Fills `len` bytes (a multiple of 8) at p with the content of page h starting at word `first`.
inline void FillWords(uint8_t* p, size_t len, uint64_t h, uint64_t first) {
  auto* w = reinterpret_cast<uint64_t*>(p);
  for (size_t i = 0; i < len / 8; ++i) w[i] = PageWord(h, first + i);
}

inline bool CheckWords(const uint8_t* p, size_t len, uint64_t h, uint64_t first) {
  auto* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t bad = 0;
  for (size_t i = 0; i < len / 8; ++i) bad |= w[i] ^ PageWord(h, first + i);
  return bad == 0;
}

}  // namespace kvbridge::bench
