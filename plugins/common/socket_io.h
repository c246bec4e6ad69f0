// Blocking-with-a-deadline socket I/O for a plugin's own TCP side channels (the verbs
// transport's QP exchange, the nccl transport's control connections): whole sends and receives
// on a non-blocking or blocking socket, bounded by a deadline on the host's clock, and the
// host's authentication handshake carried over such a socket. Every error is
// KVB_ERR_PEER_UNREACHABLE (or the handshake's own code) with a message that starts with the
// caller's label ("side channel", "nccl: control connection").
//
// Thread-safety: stateless; one socket is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvbridge/plugin/sdk/common.hpp"

namespace kvbridge::plugin {

// Waits until fd is ready for `events` (POLLIN, POLLOUT) or deadline_ns passes ("<label>: timed
// out"); a failed poll names its errno.
sdk::Status WaitFd(const sdk::Host& host, int fd, short events, uint64_t deadline_ns,
                   std::string_view label);

// Sends all len bytes by deadline_ns (MSG_NOSIGNAL).
sdk::Status SendAll(const sdk::Host& host, int fd, const void* data, size_t len,
                    uint64_t deadline_ns, std::string_view label);

// Receives exactly len bytes by deadline_ns; a peer that closes first is "<label>: closed by the
// peer".
sdk::Status RecvAll(const sdk::Host& host, int fd, void* data, size_t len, uint64_t deadline_ns,
                    std::string_view label);

// Carries the host's handshake messages (sdk::AuthSession) over fd: a client steps first with no
// input, a server receives first. Each message is read as far as AuthSession::Need asks, so
// malformed bytes are refused on the first ones. Returns the handshake's final status (OK, or
// its refusal after sending any refusal it produced), or the I/O error that cut it short.
sdk::Status CarryHandshake(const sdk::Host& host, int fd, sdk::AuthSession& session, bool client,
                           uint64_t deadline_ns, std::string_view label);

}  // namespace kvbridge::plugin
