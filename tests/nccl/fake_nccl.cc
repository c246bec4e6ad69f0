#include "tests/nccl/fake_nccl.h"

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace kvbridge::nccl::fake {
namespace {

struct Call {
  bool done = false;
  bool hung = false;
  bool send = false;
  void* buf = nullptr;
  size_t bytes = 0;
  struct Comm* comm = nullptr;
};
using CallPtr = std::shared_ptr<Call>;

struct Clique {
  struct Comm* ranks[2] = {nullptr, nullptr};
  // [from rank][to rank]: unmatched sends and recvs of that direction, in issue order.
  std::deque<CallPtr> sends[2], recvs[2];
};

struct Stream;

struct Comm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  bool aborted = false;
  int async_error = 0;
  // A call answered ncclInProgress: it reaches its stream and its direction only after
  // `enqueue_polls` more ncclCommGetAsyncError calls.
  CallPtr enqueuing;
  Stream* enqueuing_stream = nullptr;
  int enqueuing_from = 0;
  int enqueue_polls = 0;
};

struct Stream {
  std::vector<CallPtr> calls;
};

struct Event {
  std::vector<CallPtr> covers;
};

std::mutex g_mu;
std::map<std::string, std::shared_ptr<Clique>> g_cliques;
std::set<Comm*> g_comms;  // every communicator ever made, aborted ones too (see Abort)
// Frees them at exit (after every test destroyed its instances), so LeakSanitizer, which checks
// after static destructors ran, sees no communicator or clique left behind.
struct FreeCommsAtExit {
  ~FreeCommsAtExit() {
    for (Comm* c : g_comms) delete c;
    g_comms.clear();
    g_cliques.clear();
  }
} g_free_comms_at_exit;
uint64_t g_next_id = 1;
int g_hang_sends = 0;
int g_fail_async = 0;
int g_use_device = 0;
int g_slow_enqueue = 0;
Counts g_counts;

std::string Key(const ncclUniqueId& id) { return std::string(id.internal, sizeof(id.internal)); }

// Pairs the fronts of one direction while both are there and neither is hung.
void Match(Clique& c, int from) {
  auto& s = c.sends[from];
  auto& r = c.recvs[from];
  while (!s.empty() && !r.empty() && !s.front()->hung) {
    CallPtr a = s.front(), b = r.front();
    s.pop_front();
    r.pop_front();
    std::memcpy(b->buf, a->buf, std::min(a->bytes, b->bytes));
    g_counts.bytes_copied += std::min(a->bytes, b->bytes);
    a->done = b->done = true;
  }
}

void DropCalls(Comm* comm) {
  if (!comm->clique) return;
  for (int d = 0; d < 2; ++d) {
    for (auto* q : {&comm->clique->sends[d], &comm->clique->recvs[d]}) {
      for (auto it = q->begin(); it != q->end();) {
        if ((*it)->comm == comm) {
          (*it)->done = true;  // an abort ends the kernels: their stream moves on
          it = q->erase(it);
        } else {
          ++it;
        }
      }
    }
  }
}

ncclResult_t GetVersion(int* v) {
  *v = 22809;
  return ncclSuccess;
}
ncclResult_t GetUniqueId(ncclUniqueId* id) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::memset(id->internal, 0, sizeof(id->internal));
  const uint64_t n = g_next_id++;
  std::memcpy(id->internal, "fake", 4);
  std::memcpy(id->internal + 8, &n, sizeof(n));
  return ncclSuccess;
}
ncclResult_t InitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                            ncclConfig_t* config) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (nranks != 2 || rank < 0 || rank > 1) return 4;  // ncclInvalidArgument
  auto& clique = g_cliques[Key(id)];
  if (!clique) clique = std::make_shared<Clique>();
  if (clique->ranks[rank] != nullptr) return 5;  // ncclInvalidUsage: a unique id inits once
  auto* c = new Comm;
  c->clique = clique;
  c->rank = rank;
  clique->ranks[rank] = c;
  g_comms.insert(c);
  ++g_counts.comms_created;
  *out = reinterpret_cast<ncclComm_t>(c);
  return config != nullptr && config->blocking == 0 ? ncclInProgress : ncclSuccess;
}
ncclResult_t InitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  return InitRankConfig(out, nranks, id, rank, nullptr);
}
ncclResult_t Abort(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* c = reinterpret_cast<Comm*>(comm);
  if (g_comms.count(c) == 0 || c->aborted) {
    ++g_counts.calls_after_abort;
    return 4;
  }
  c->aborted = true;
  ++g_counts.comms_aborted;
  DropCalls(c);
  c->clique->ranks[c->rank] = nullptr;
  return ncclSuccess;
}
ncclResult_t GetAsyncError(ncclComm_t comm, ncclResult_t* async) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* c = reinterpret_cast<Comm*>(comm);
  if (g_comms.count(c) == 0 || c->aborted) {
    ++g_counts.calls_after_abort;
    return 4;
  }
  if (c->enqueuing) {
    if (--c->enqueue_polls > 0) {
      *async = ncclInProgress;
      return ncclSuccess;
    }
    c->enqueuing_stream->calls.push_back(c->enqueuing);
    auto& q = c->enqueuing->send ? c->clique->sends[c->enqueuing_from]
                                 : c->clique->recvs[c->enqueuing_from];
    q.push_back(c->enqueuing);
    c->enqueuing.reset();
    Match(*c->clique, c->enqueuing_from);
  }
  const bool joined = c->clique->ranks[0] != nullptr && c->clique->ranks[1] != nullptr;
  if (c->async_error == 0 && g_fail_async != 0 && joined) {
    c->async_error = g_fail_async;
    g_fail_async = 0;
  }
  *async = c->async_error != 0 ? c->async_error : (joined ? ncclSuccess : ncclInProgress);
  return ncclSuccess;
}
ncclResult_t P2p(bool send, void* buf, size_t count, int peer, ncclComm_t comm,
                 cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* c = reinterpret_cast<Comm*>(comm);
  if (g_comms.count(c) == 0 || c->aborted) {
    ++g_counts.calls_after_abort;
    return 4;
  }
  if (peer != 1 - c->rank || stream == nullptr) return 4;
  if (c->enqueuing) ++g_counts.calls_while_enqueuing;
  auto call = std::make_shared<Call>();
  call->send = send;
  call->buf = buf;
  call->bytes = count;
  call->comm = c;
  if (send && g_hang_sends > 0) {
    --g_hang_sends;
    call->hung = true;
  }
  const int from = send ? c->rank : peer;
  (send ? g_counts.sends : g_counts.recvs)++;
  if (g_slow_enqueue > 0) {
    --g_slow_enqueue;
    c->enqueuing = call;
    c->enqueuing_stream = static_cast<Stream*>(stream);
    c->enqueuing_from = from;
    c->enqueue_polls = 3;
    return ncclInProgress;
  }
  (send ? c->clique->sends[from] : c->clique->recvs[from]).push_back(call);
  static_cast<Stream*>(stream)->calls.push_back(call);
  Match(*c->clique, from);
  return ncclSuccess;
}
ncclResult_t Send(const void* buf, size_t count, ncclDataType_t, int peer, ncclComm_t comm,
                  cudaStream_t stream) {
  return P2p(true, const_cast<void*>(buf), count, peer, comm, stream);
}
ncclResult_t Recv(void* buf, size_t count, ncclDataType_t, int peer, ncclComm_t comm,
                  cudaStream_t stream) {
  return P2p(false, buf, count, peer, comm, stream);
}
ncclResult_t Destroy(ncclComm_t comm) { return Abort(comm); }
ncclResult_t GroupNop() { return ncclSuccess; }
const char* ErrorString(ncclResult_t r) {
  switch (r) {
    case 2:
      return "unhandled system error (fake)";
    case 3:
      return "internal error (fake)";
    case 6:
      return "remote process exited or there was a network error (fake)";
    default:
      return "fake NCCL error";
  }
}

int UseDevice(int) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_use_device;
}
int StreamCreate(cudaStream_t* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  *out = new Stream;
  ++g_counts.live_streams;
  return 0;
}
int StreamDestroy(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(g_mu);
  delete static_cast<Stream*>(s);
  --g_counts.live_streams;
  return 0;
}
int EventCreate(CudaEvent* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  *out = new Event;
  ++g_counts.live_events;
  return 0;
}
int EventRecord(CudaEvent e, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* st = static_cast<Stream*>(s);
  // Forget calls that are done: the stream only needs the pending ones.
  std::erase_if(st->calls, [](const CallPtr& c) { return c->done; });
  static_cast<Event*>(e)->covers = st->calls;
  return 0;
}
int EventQuery(CudaEvent e) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const CallPtr& c : static_cast<Event*>(e)->covers) {
    if (!c->done) return kCudaNotReady;
  }
  return 0;
}
int EventDestroy(CudaEvent e) {
  std::lock_guard<std::mutex> lock(g_mu);
  delete static_cast<Event*>(e);
  --g_counts.live_events;
  return 0;
}
const char* CudaErrorName(int r) { return r == 100 ? "CUDA_ERROR_NO_DEVICE" : nullptr; }

}  // namespace

const Nccl* FakeNccl() {
  static const Nccl* n = [] {
    auto* t = new Nccl;
    t->path = "fake";
    t->file = "fake";
    t->version_code = 22809;
    t->major = 2;
    t->minor = 28;
    t->patch = 9;
    t->ncclGetVersion = GetVersion;
    t->ncclGetUniqueId = GetUniqueId;
    t->ncclCommInitRank = InitRank;
    t->ncclCommAbort = Abort;
    t->ncclCommDestroy = Destroy;
    t->ncclCommGetAsyncError = GetAsyncError;
    t->ncclSend = Send;
    t->ncclRecv = Recv;
    t->ncclGroupStart = GroupNop;
    t->ncclGroupEnd = GroupNop;
    t->ncclGetErrorString = ErrorString;
    t->ncclCommInitRankConfig = InitRankConfig;
    return t;
  }();
  return n;
}

const CudaOps* FakeCuda() {
  static const CudaOps* c = [] {
    auto* t = new CudaOps;
    t->path = "fake";
    t->use_device = UseDevice;
    t->stream_create = StreamCreate;
    t->stream_destroy = StreamDestroy;
    t->event_create = EventCreate;
    t->event_record = EventRecord;
    t->event_query = EventQuery;
    t->event_destroy = EventDestroy;
    t->error_name = CudaErrorName;
    return t;
  }();
  return c;
}

void HangNextSends(int n) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_hang_sends = n;
}
void FailNextAsyncQuery(int err) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fail_async = err;
}
void SlowEnqueueNext(int n) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_slow_enqueue = n;
}
void SetUseDeviceResult(int r) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_use_device = r;
}
void ResetFaults() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_hang_sends = 0;
  g_fail_async = 0;
  g_use_device = 0;
  g_slow_enqueue = 0;
}
Counts GetCounts() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_counts;
}

}  // namespace kvbridge::nccl::fake
