// Internals shared by the worker's files (ucx_worker.cc: thread, memory, timers; ucx_peers.cc:
// endpoints, hellos, grants; ucx_requests.cc: issuing RMA and completions): the active-message
// kinds and header, and the record of one UCX operation in flight. Progress-thread-only.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ucx_worker.h"

namespace kvbridge::ucx {

constexpr unsigned kAmId = 0x4b56;  // one AM id for both directions of the hello
constexpr uint32_t kHelloToServer = 1;
constexpr uint32_t kHelloToClient = 2;
// Grants (payload: the u64 segment id): an initiator asks before its first RMA to a segment on
// an endpoint; the target revokes before its deregister_memory returns. A grant request goes on
// with the initiator's error mode (u8, 1 = PEER) and endpoints text, where the target sends the
// revocation from an endpoint of its own (Worker::BackEndpoint); one of 8 bytes (no address)
// is still served, its revocation bounded by the progress timeout.
constexpr uint32_t kGrantRequest = 3;
constexpr uint32_t kMaxGrantRequest = 16384;
constexpr uint32_t kGrantReply = 4;  // status KVB_OK or KVB_ERR_NOT_REGISTERED
constexpr uint32_t kRevoke = 5;
constexpr uint32_t kRevokeAck = 6;

// The AM header of every hello message; the auth message is the AM payload.
struct HelloHeader {
  uint64_t session;
  int32_t status;  // the sender's auth_step result (KVB_IN_PROGRESS, KVB_OK or an error)
  uint32_t kind;
};

inline std::string UcsText(ucs_status_t st) { return ucs_status_string(st); }

// One UCX operation in flight. kPut/kGet touch `slice`'s local memory until they complete.
struct Record {
  enum class Kind { kPut, kGet, kFlush, kAm };
  Kind kind;
  Worker* worker;
  Endpoint* ep;  // null for hello replies on a server's reply endpoint
  SlicePtr slice;
  bool detached = false;  // no longer counted in the request's in_ucx (its peer has exited)
  std::vector<SlicePtr> flushed;
  HelloHeader header{};
  std::string data;

  Record(Kind k, Worker* w, Endpoint* e, SlicePtr s = nullptr)
      : kind(k), worker(w), ep(e), slice(std::move(s)) {}
};

}  // namespace kvbridge::ucx
