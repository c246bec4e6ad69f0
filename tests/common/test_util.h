// Shared helpers for kvbridge tests: engines on loopback, patterned buffers, child processes.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/engine.h"

namespace kvbridge::testing {

// Page-aligned, zeroed buffer.
class Buffer {
 public:
  explicit Buffer(size_t n);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return n_; }
  // Deterministic bytes derived from (seed, absolute offset).
  void Fill(uint64_t seed, size_t off = 0, size_t len = SIZE_MAX);
  bool Matches(uint64_t seed, size_t off, size_t len, size_t pattern_off) const;

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

uint8_t PatternByte(uint64_t seed, size_t offset);

// Options for an engine on loopback using exactly `transport`; the mock's directory is added.
EngineOptions LoopbackOptions(const std::string& transport, const std::string& node_id);

// A per-transport suite parameter (tests/conformance, tests/fault): a transport plugin's name, or
// "ucx_net": ucx with ucx.same_host=off (PEER-mode endpoints over the network transports).
struct TransportParam {
  std::string transport;                      // the plugin's name
  std::map<std::string, std::string> config;  // plugin_config entries the parameter implies
};
TransportParam ParseTransportParam(const std::string& param);
// LoopbackOptions for the parameter's transport, with its config.
// The minor version of the libucp this process has loaded (the ucx plugin's: Debian's 1.13, or
// PyPI's 1.22 with KVBRIDGE_PLUGIN_PATH=build/plugins_ucx_pypi); 0 when none is loaded.
unsigned LoadedUcxMinor();

// True where the target's CPU takes no part in RMA, so a frozen (SIGSTOPped) peer does not
// stall a transfer to it at all: the "ucx" parameter (same-host endpoints) when the loaded UCX
// moves same-host RMA through cma (1.22), and "verbs" (the target's NIC serves RDMA).
bool OneSidedRma(const std::string& param);

// The RDMA ports this machine has (/sys/class/infiniband/<device>/ports/<n>); 0 without any.
uint64_t RdmaPorts();

// Non-empty when `st`, a host buffer's registration with an engine over the parameter's
// transport, was refused UNSUPPORTED, as a device-memory-only transport (nccl) refuses it: the
// reason a per-transport case that moves host memory skips, naming where that transport's
// device-memory cases are.
std::string HostMemoryRefused(const std::string& param, const Status& st);

EngineOptions ParamLoopbackOptions(const std::string& param, const std::string& node_id);
// kvb_test_peer flags that make the peer use the parameter's transport and config.
std::vector<std::string> PeerTransportArgs(const std::string& param);

// Unwraps a Result in tests, failing the test with the status on error.
template <typename T>
T Must(Result<T> r) {
  if (!r.ok()) {
    fprintf(stderr, "unexpected error: %s\n", r.status().ToString().c_str());
    abort();
  }
  return std::move(r).value();
}

// A free TCP port on 127.0.0.1 (bound then released; the kernel will not hand it out again
// right away).
uint16_t FreePort();

// A child process with pipes to its stdin and stdout; killed (SIGKILL) when destroyed.
class ChildProcess {
 public:
  // argv[0] is the program's path. `prefix` runs it under another command found on PATH,
  // e.g. {"ip", "netns", "exec", "ns1"}.
  static std::unique_ptr<ChildProcess> Start(const std::vector<std::string>& argv,
                                             const std::vector<std::string>& prefix = {});
  ChildProcess(ChildProcess&& other) noexcept;
  virtual ~ChildProcess();
  pid_t pid() const { return pid_; }
  bool alive() const { return pid_ > 0; }
  // The next stdout line ("" on EOF or timeout).
  std::string ReadLine(int timeout_ms = 10000);
  // Everything the process writes to stdout until it closes it (or timeout_ms passes).
  std::string ReadAll(int timeout_ms = 10000);
  // Sends one line to stdin and returns the next stdout line.
  std::string Command(const std::string& line, int timeout_ms = 10000);
  // Sends a signal; for SIGSTOP/SIGCONT, returns once the process is stopped/running.
  void Signal(int sig);
  // kill -9 and reap.
  void Kill();
  // Waits up to timeout_ms for the process to exit: its exit code (128+signal if killed), or
  // -1 if it is still running.
  int Wait(int timeout_ms);

 protected:
  ChildProcess() = default;

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffered_;
};

// tests' peer program (kvb_test_peer): one registered, patterned region; answers commands.
class PeerProcess : public ChildProcess {
 public:
  // args after the program name, e.g. {"--node-id", "b", "--listen", "127.0.0.1:0"}.
  static std::unique_ptr<PeerProcess> Start(const std::vector<std::string>& args,
                                            const std::vector<std::string>& prefix = {});
  const std::string& descriptor() const { return descriptor_; }

 private:
  explicit PeerProcess(ChildProcess&& child) : ChildProcess(std::move(child)) {}
  std::string descriptor_;
};

std::string HexEncode(const std::string& bytes);
std::string HexDecode(const std::string& hex);

// Counts TCP sockets in /proc/net/tcp{,6} whose remote port is `port`, by state.
struct SocketCounts {
  int established = 0;
  int time_wait = 0;
  int other = 0;
};
SocketCounts CountSocketsToPort(uint16_t port);

// A network namespace holding one "remote host" reached over `nics` veth pairs, so tests can
// give a peer several NICs and cut one (link down drops every packet, like a pulled cable).
// NIC i (0-based) is 10.<n>.<i+1>.1 on this side and 10.<n>.<i+1>.2 inside the namespace,
// n picked per namespace among 10.100-249 networks no address or route of this host uses
// (starting from one the process id gives), so that tests running at once (ctest -j) each
// reach their own namespace. Needs root and iproute2; Create() returns null with the reason
// otherwise.
class NetNamespace {
 public:
  static std::unique_ptr<NetNamespace> Create(int nics, std::string* why);
  ~NetNamespace();
  const std::string& name() const { return name_; }
  std::string RemoteAddress(int nic) const { return Address(nic, 2); }
  std::string LocalAddress(int nic) const { return Address(nic, 1); }
  // Brings this side of NIC `nic` up or down.
  bool SetLink(int nic, bool up);
  // Runs a shell command inside the namespace (output discarded); true if it exited 0.
  bool Exec(const std::string& cmd) const;

 private:
  std::string Address(int nic, int host) const {
    return "10." + std::to_string(net_) + "." + std::to_string(nic + 1) + "." +
           std::to_string(host);
  }
  std::string name_;
  int net_ = 0;                     // the second octet of this namespace's networks
  std::vector<std::string> links_;  // this side's veth ends
};

}  // namespace kvbridge::testing
