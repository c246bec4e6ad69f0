// kvb_bench_ucp: plain UCP between two processes, no kvbridge. Batches of --batch puts (or gets)
// of one block, the same local and remote block every time, --window batches in flight; a put
// batch ends when an endpoint flush issued after its puts completes (the target has the
// bytes), a get batch when its last get completes. That is what a kvbridge WRITE or READ batch
// asks of UCX (remote completion), without the plugin: next to ucx_perftest's ucp_put_bw, which
// keeps puts outstanding and flushes once at the end, it tells the cost of remote completion
// from the plugin's own (benchmarks/run ucx, docs/transports/ucx.md).
//
// The process forks the target before either side touches UCX; the two exchange the target's
// worker address, packed rkey and block address over a socketpair. UCX_TLS comes from the
// environment, as for ucx_perftest. The last stdout line is one JSON object.
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iostream>
#include <string>

#include "benchlib.h"

namespace bl = kvbridge::benchlib;

namespace {

struct Args {
  std::string op = "write";
  uint64_t block = 65536;
  int batch = 16;
  int window = 2;
  double seconds = 2.0;
  bool peer_mode = false;  // UCP_ERR_HANDLING_MODE_PEER on the endpoint (kvbridge's tcp set)
};

[[noreturn]] void Die(const std::string& what, ucs_status_t st = UCS_OK) {
  std::cerr << "kvb_bench_ucp: " << what;
  if (st != UCS_OK) std::cerr << ": " << ucs_status_string(st);
  std::cerr << "\n";
  _exit(1);
}

void Check(ucs_status_t st, const char* what) {
  if (st != UCS_OK) Die(what, st);
}

void SendBlob(int fd, const void* p, uint64_t n) {
  if (!bl::SendAll(fd, &n, sizeof(n)) || !bl::SendAll(fd, p, n)) Die("socketpair write failed");
}

std::string RecvBlob(int fd) {
  uint64_t n = 0;
  if (!bl::RecvAll(fd, &n, sizeof(n)) || n > (64u << 20)) Die("socketpair read failed");
  std::string s(n, '\0');
  if (!bl::RecvAll(fd, s.data(), n)) Die("socketpair read failed");
  return s;
}

// One UCP context and worker, and one block of huge-page-backed memory mapped in it (as the
// bench's --memory thp and ucx_perftest's own allocator).
struct Side {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  void* block = nullptr;
  size_t bytes = 0;
  ucp_mem_h memh = nullptr;

  explicit Side(uint64_t block_bytes) {
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_RMA;
    Check(ucp_init(&p, nullptr, &context), "ucp_init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    Check(ucp_worker_create(context, &wp, &worker), "ucp_worker_create");
    bytes = (block_bytes + (2u << 20) - 1) & ~size_t((2u << 20) - 1);
    block = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) Die("mmap of " + std::to_string(bytes) + " bytes failed");
    madvise(block, bytes, MADV_HUGEPAGE);
    memset(block, 0x5a, bytes);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = block;
    mp.length = bytes;
    Check(ucp_mem_map(context, &mp, &memh), "ucp_mem_map");
  }
};

// The target: publishes its worker address, rkey and block, then progresses until the
// initiator closes its end of the socketpair.
int RunTarget(const Args& a, int fd) {
  Side s(a.block);
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  Check(ucp_worker_get_address(s.worker, &addr, &addr_len), "ucp_worker_get_address");
  void* rkey = nullptr;
  size_t rkey_len = 0;
  Check(ucp_rkey_pack(s.context, s.memh, &rkey, &rkey_len), "ucp_rkey_pack");
  const uint64_t base = reinterpret_cast<uintptr_t>(s.block);
  SendBlob(fd, addr, addr_len);
  SendBlob(fd, rkey, rkey_len);
  SendBlob(fd, &base, sizeof(base));
  pollfd pfd{fd, POLLIN, 0};
  for (uint64_t i = 0;; ++i) {
    ucp_worker_progress(s.worker);
    if ((i & 255) == 0 && poll(&pfd, 1, 0) > 0) break;  // EOF: the initiator is done
  }
  _exit(0);
}

// A batch in flight: completions still expected (gets, or the one flush of a put batch).
struct Batch {
  int left = 0;
};

void OnDone(void* request, ucs_status_t st, void* user) {
  if (st != UCS_OK) Die("a UCP operation failed", st);
  --static_cast<Batch*>(user)->left;
  ucp_request_free(request);
}

void OnEpError(void*, ucp_ep_h, ucs_status_t st) { Die("endpoint error", st); }

// Issues one op; counts it in `b` unless it completed at once.
void Track(ucs_status_ptr_t r, Batch* b, const char* what) {
  if (UCS_PTR_IS_ERR(r)) Die(what, UCS_PTR_STATUS(r));
  if (r != nullptr) ++b->left;
}

int RunInitiator(const Args& a) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) Die("socketpair failed");
  const pid_t pid = fork();
  if (pid < 0) Die("fork failed");
  if (pid == 0) {
    close(sv[0]);
    return RunTarget(a, sv[1]);
  }
  close(sv[1]);
  Side s(a.block);
  const std::string addr = RecvBlob(sv[0]);
  const std::string rkey_blob = RecvBlob(sv[0]);
  const std::string base_blob = RecvBlob(sv[0]);
  uint64_t remote = 0;
  memcpy(&remote, base_blob.data(), sizeof(remote));

  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
  ep.err_mode = a.peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (a.peer_mode) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = OnEpError;
  }
  ucp_ep_h e = nullptr;
  Check(ucp_ep_create(s.worker, &ep, &e), "ucp_ep_create");
  ucp_rkey_h rkey = nullptr;
  Check(ucp_ep_rkey_unpack(e, rkey_blob.data(), &rkey), "ucp_ep_rkey_unpack");

  const bool write = a.op == "write";
  std::deque<Batch> inflight;  // deque: a Batch's address stays valid while it is in flight
  auto post = [&] {
    Batch& b = inflight.emplace_back();
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = OnDone;
    rp.user_data = &b;
    for (int i = 0; i < a.batch; ++i) {
      if (write) {
        // A put's own completion is not awaited (only the local buffer's reuse): the flush is.
        ucp_request_param_t np{};
        ucs_status_ptr_t r = ucp_put_nbx(e, s.block, a.block, remote, rkey, &np);
        if (UCS_PTR_IS_ERR(r)) Die("ucp_put_nbx", UCS_PTR_STATUS(r));
        if (r != nullptr) ucp_request_free(r);
      } else {
        Track(ucp_get_nbx(e, s.block, a.block, remote, rkey, &rp), &b, "ucp_get_nbx");
      }
    }
    if (write) Track(ucp_ep_flush_nbx(e, &rp), &b, "ucp_ep_flush_nbx");
  };
  // Runs batches for `seconds`; returns the bytes of those that completed.
  auto run = [&](double seconds) {
    uint64_t bytes = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < until) {
      while (static_cast<int>(inflight.size()) < a.window) post();
      while (inflight.front().left > 0) ucp_worker_progress(s.worker);
      inflight.pop_front();
      bytes += a.block * uint64_t(a.batch);
    }
    while (!inflight.empty()) {
      while (inflight.front().left > 0) ucp_worker_progress(s.worker);
      inflight.pop_front();
    }
    return bytes;
  };
  run(std::min(0.3, a.seconds));  // connection set-up and warm-up
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t bytes = run(a.seconds);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  ucp_rkey_destroy(rkey);
  // Every batch completed: a flush close. FORCE is defined only for PEER-mode endpoints.
  ucp_request_param_t cp{};
  if (a.peer_mode) {
    cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  ucs_status_ptr_t cr = ucp_ep_close_nbx(e, &cp);
  if (UCS_PTR_IS_PTR(cr)) {
    while (ucp_request_check_status(cr) == UCS_INPROGRESS) ucp_worker_progress(s.worker);
    ucp_request_free(cr);
  }
  close(sv[0]);  // the target's cue to exit
  waitpid(pid, nullptr, 0);

  bl::Json j;
  j.BeginObject()
      .Field("benchmark", "ucp")
      .Field("op", a.op)
      .Field("block_bytes", a.block)
      .Field("batch", a.batch)
      .Field("window", a.window)
      .Field("peer_mode", a.peer_mode)
      .Field("seconds", secs, 3)
      .Field("gbps", bl::Gbps(bytes, secs), 3)
      .EndObject();
  bl::PrintResult(j);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bl::Flags f("kvb_bench_ucp",
              "Plain UCP puts (flushed per batch) or gets between two processes: the remote-"
              "completion baseline of benchmarks/run ucx.");
  f.String("op", &a.op, "write (puts, then an endpoint flush per batch) or read (gets)",
           {"write", "read"});
  f.UInt64("block", &a.block, "bytes per op", 1);
  f.Int("batch", &a.batch, "ops per batch", 1);
  f.Int("window", &a.window, "batches in flight", 1);
  f.Double("seconds", &a.seconds, "seconds measured (after a warm-up of up to 0.3 s)", 0.001);
  f.Bool("peer-mode", &a.peer_mode, "UCP_ERR_HANDLING_MODE_PEER endpoint (as ucx_perftest -e)");
  f.ParseOrExit(argc, argv);
  return RunInitiator(a);
}
