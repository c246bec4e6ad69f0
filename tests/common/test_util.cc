#include "tests/common/test_util.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "util/hex.h"

namespace kvbridge::testing {

Buffer::Buffer(size_t n) : n_(n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) abort();
  p_ = static_cast<uint8_t*>(p);
}

Buffer::~Buffer() { munmap(p_, n_); }

uint8_t PatternByte(uint64_t seed, size_t offset) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + (offset >> 3) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return static_cast<uint8_t>(x >> ((offset & 7) * 8));
}

void Buffer::Fill(uint64_t seed, size_t off, size_t len) {
  if (len == SIZE_MAX) len = n_ - off;
  for (size_t i = 0; i < len; ++i) p_[off + i] = PatternByte(seed, off + i);
}

bool Buffer::Matches(uint64_t seed, size_t off, size_t len, size_t pattern_off) const {
  for (size_t i = 0; i < len; ++i) {
    if (p_[off + i] != PatternByte(seed, pattern_off + i)) return false;
  }
  return true;
}

EngineOptions LoopbackOptions(const std::string& transport, const std::string& node_id) {
  EngineOptions o;
  o.node_id = node_id;
  o.transports = {transport};
  o.listen = "127.0.0.1:0";
  o.plugin_path = KVBRIDGE_TEST_PLUGIN_BUILD_DIR;
  // These engines test their transport: peers in this process go through it too.
  o.local_copy = false;
  return o;
}

TransportParam ParseTransportParam(const std::string& param) {
  if (param == "ucx_net") return {"ucx", {{"ucx.same_host", "off"}}};
  if (param == "ucx") return {"ucx", {{"ucx.same_host", "auto"}}};
  return {param, {}};
}

EngineOptions ParamLoopbackOptions(const std::string& param, const std::string& node_id) {
  const TransportParam p = ParseTransportParam(param);
  EngineOptions o = LoopbackOptions(p.transport, node_id);
  for (const auto& [k, v] : p.config) o.plugin_config[k] = v;
  return o;
}

std::vector<std::string> PeerTransportArgs(const std::string& param) {
  const TransportParam p = ParseTransportParam(param);
  std::vector<std::string> args = {"--transport", p.transport};
  for (const auto& [k, v] : p.config) {
    args.push_back("--config");
    args.push_back(k + "=" + v);
  }
  return args;
}

unsigned LoadedUcxMinor() {
  void* h = dlopen("libucp.so.0", RTLD_LAZY | RTLD_NOLOAD);
  if (h == nullptr) return 0;
  using GetVersion = void (*)(unsigned*, unsigned*, unsigned*);
  auto get = reinterpret_cast<GetVersion>(dlsym(h, "ucp_get_version"));
  unsigned major = 0, minor = 0, release = 0;
  if (get != nullptr) get(&major, &minor, &release);
  dlclose(h);
  return major == 1 ? minor : 0;
}

bool OneSidedRma(const std::string& param) {
  return (param == "ucx" && LoadedUcxMinor() >= 22) || param == "verbs";
}

uint64_t RdmaPorts() {
  std::error_code ec;
  uint64_t n = 0;
  for (const auto& dev : std::filesystem::directory_iterator("/sys/class/infiniband", ec)) {
    for (const auto& port [[maybe_unused]] :
         std::filesystem::directory_iterator(dev.path() / "ports", ec)) {
      ++n;
    }
  }
  return n;
}

std::string HostMemoryRefused(const std::string& param, const Status& st) {
  if (st.code() != StatusCode::kUnsupported) return "";
  const std::string t = ParseTransportParam(param).transport;
  std::string why = "transport '" + param + "' takes no host memory (" + st.ToString() + ")";
  if (t == "nccl") why += "; its device-memory cases are kvb_nccl_tests (tests/nccl)";
  return why;
}

uint16_t FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

std::unique_ptr<ChildProcess> ChildProcess::Start(const std::vector<std::string>& argv_in,
                                                  const std::vector<std::string>& prefix) {
  int in_pipe[2], out_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0 || pipe2(out_pipe, O_CLOEXEC) != 0) return nullptr;
  // A prefix command is found on PATH through env(1); every command in the chain exec()s the
  // next, so the pid we get is the program's own and signals reach it.
  std::vector<std::string> argv_s;
  if (!prefix.empty()) {
    argv_s.push_back("/usr/bin/env");
    argv_s.insert(argv_s.end(), prefix.begin(), prefix.end());
  }
  argv_s.insert(argv_s.end(), argv_in.begin(), argv_in.end());
  const std::string prog = argv_s.front();
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(in_pipe[0], STDIN_FILENO);
    dup2(out_pipe[1], STDOUT_FILENO);
    execv(prog.c_str(), argv.data());
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  auto p = std::unique_ptr<ChildProcess>(new ChildProcess());
  p->pid_ = pid;
  p->to_child_ = in_pipe[1];
  p->from_child_ = out_pipe[0];
  return p;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) Kill();
  if (to_child_ >= 0) close(to_child_);
  if (from_child_ >= 0) close(from_child_);
}

std::string ChildProcess::ReadLine(int timeout_ms) {
  for (;;) {
    size_t nl = buffered_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return line;
    }
    pollfd pfd{from_child_, POLLIN, 0};
    if (poll(&pfd, 1, timeout_ms) <= 0) return "";
    char buf[4096];
    ssize_t n = read(from_child_, buf, sizeof(buf));
    if (n <= 0) return "";
    buffered_.append(buf, static_cast<size_t>(n));
  }
}

std::string ChildProcess::ReadAll(int timeout_ms) {
  std::string out = std::move(buffered_);
  buffered_.clear();
  for (;;) {
    pollfd pfd{from_child_, POLLIN, 0};
    if (poll(&pfd, 1, timeout_ms) <= 0) return out;
    char buf[4096];
    ssize_t n = read(from_child_, buf, sizeof(buf));
    if (n <= 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

std::string ChildProcess::Command(const std::string& line, int timeout_ms) {
  std::string l = line + "\n";
  if (write(to_child_, l.data(), l.size()) != static_cast<ssize_t>(l.size())) return "";
  return ReadLine(timeout_ms);
}

namespace {

// The state letter of /proc/<pid>/stat ('R', 'S', 'T' for stopped, ...), or 0.
char ProcessState(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : 0;
}

}  // namespace

void ChildProcess::Signal(int sig) {
  if (pid_ <= 0) return;
  kill(pid_, sig);
  // kill(2) returns before the target has stopped or resumed; wait until it has, so a test
  // that freezes a process really measures a frozen process.
  if (sig != SIGSTOP && sig != SIGCONT) return;
  for (int i = 0; i < 2000; ++i) {
    const bool stopped = ProcessState(pid_) == 'T';
    if (stopped == (sig == SIGSTOP)) return;
    usleep(1000);
  }
}

void ChildProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

int ChildProcess::Wait(int timeout_ms) {
  if (pid_ <= 0) return -1;
  for (int waited = 0;; waited += 5) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (waited >= timeout_ms) return -1;
    usleep(5000);
  }
}

std::unique_ptr<PeerProcess> PeerProcess::Start(const std::vector<std::string>& args,
                                                const std::vector<std::string>& prefix) {
  std::vector<std::string> argv = {std::string(KVBRIDGE_TEST_BIN_DIR) + "/kvb_test_peer"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::unique_ptr<ChildProcess> child = ChildProcess::Start(argv, prefix);
  if (!child) return nullptr;
  auto p = std::unique_ptr<PeerProcess>(new PeerProcess(std::move(*child)));
  std::string line = p->ReadLine(20000);
  if (line.rfind("DESC ", 0) != 0) {
    fprintf(stderr, "peer did not start: '%s'\n", line.c_str());
    return nullptr;
  }
  p->descriptor_ = HexDecode(line.substr(5));
  return p;
}

ChildProcess::ChildProcess(ChildProcess&& o) noexcept
    : pid_(o.pid_),
      to_child_(o.to_child_),
      from_child_(o.from_child_),
      buffered_(std::move(o.buffered_)) {
  o.pid_ = -1;
  o.to_child_ = -1;
  o.from_child_ = -1;
}

std::string HexEncode(const std::string& bytes) { return util::HexEncode(bytes); }

std::string HexDecode(const std::string& hex) {
  std::string out;
  if (!util::HexDecode(hex, &out)) out.clear();
  return out;
}

SocketCounts CountSocketsToPort(uint16_t port) {
  SocketCounts c;
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream f(path);
    std::string line;
    std::getline(f, line);  // header
    while (std::getline(f, line)) {
      std::istringstream ss(line);
      std::string sl, local, remote, state;
      ss >> sl >> local >> remote >> state;
      size_t colon = remote.rfind(':');
      if (colon == std::string::npos) continue;
      unsigned rport = std::stoul(remote.substr(colon + 1), nullptr, 16);
      if (rport != port) continue;
      if (state == "01") {
        ++c.established;
      } else if (state == "06") {
        ++c.time_wait;
      } else {
        ++c.other;
      }
    }
  }
  return c;
}

}  // namespace kvbridge::testing

namespace kvbridge::testing {
namespace {

bool Run(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

}  // namespace

std::unique_ptr<NetNamespace> NetNamespace::Create(int nics, std::string* why) {
  if (geteuid() != 0) {
    *why = "needs root to create network namespaces";
    return nullptr;
  }
  if (!Run("ip -V")) {
    *why = "iproute2 ('ip') is not installed";
    return nullptr;
  }
  auto ns = std::unique_ptr<NetNamespace>(new NetNamespace());
  const std::string tag = std::to_string(getpid() % 100000);
  // A 10.<n>.0.0/16 nothing here uses yet (another test's namespace, the host's own network).
  for (int k = 0; k < 150 && ns->net_ == 0; ++k) {
    const int n = 100 + (getpid() + k) % 150;
    if (Run("! { ip -4 addr show; ip -4 route show; } | grep -q '10\\." + std::to_string(n) +
            "\\.'")) {
      ns->net_ = n;
    }
  }
  if (ns->net_ == 0) {
    *why = "no free 10.100-249.0.0/16 network for the namespace's links";
    return nullptr;
  }
  ns->name_ = "kvbt" + tag;
  if (!Run("ip netns add " + ns->name_)) {
    *why = "'ip netns add' failed (no CAP_SYS_ADMIN in this sandbox?)";
    ns->name_.clear();
    return nullptr;
  }
  const std::string in_ns = "ip netns exec " + ns->name_ + " ";
  bool ok = Run(in_ns + "ip link set lo up");
  for (int i = 0; i < nics && ok; ++i) {
    const std::string here = "kvh" + tag + "_" + std::to_string(i);
    const std::string there = "kvr" + tag + "_" + std::to_string(i);
    const std::string net = "10." + std::to_string(ns->net_) + "." + std::to_string(i + 1);
    ok = Run("ip link add " + here + " type veth peer name " + there) &&
         Run("ip link set " + there + " netns " + ns->name_) &&
         Run("ip addr add " + net + ".1/24 dev " + here) && Run("ip link set " + here + " up") &&
         Run(in_ns + "ip addr add " + net + ".2/24 dev " + there) &&
         Run(in_ns + "ip link set " + there + " up");
    if (ok) ns->links_.push_back(here);
  }
  if (!ok) {
    *why = "could not set up veth pairs in namespace " + ns->name_;
    return nullptr;  // the destructor removes what was made
  }
  return ns;
}

NetNamespace::~NetNamespace() {
  for (const auto& l : links_) Run("ip link del " + l);
  if (!name_.empty()) Run("ip netns del " + name_);
}

bool NetNamespace::Exec(const std::string& cmd) const {
  return Run("ip netns exec " + name_ + " " + cmd);
}

bool NetNamespace::SetLink(int nic, bool up) {
  if (nic < 0 || nic >= static_cast<int>(links_.size())) return false;
  return Run("ip link set " + links_[nic] + (up ? " up" : " down"));
}

}  // namespace kvbridge::testing
