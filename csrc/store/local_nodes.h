// Storage nodes of this process, for the store clients of the same process (an embedded
// deployment: the client's setup contributes the segment its puts go to). A put's inventory
// commit to such a node is not a call from the master into this process but a record the
// master returns with its PutEnd answer (PutEndRequest.local_nodes), which the client applies
// here before it reports the put done: two control-plane hops less per put (docs/store.md
// "Puts"). Internal to the store.
#pragma once

#include <chrono>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge.pb.h"
#include "kvbridge/status.h"
#include "store/master_state.h"

namespace kvbridge::store {

// Of `nodes` ((node id, incarnation) pairs), those that are storage nodes serving in this
// process with this cluster token.
std::vector<NodeIdentity> LocalNodesAmong(const std::set<std::pair<std::string, uint64_t>>& nodes,
                                          const std::string& cluster_token);

// The ranges ((segment id, offset) pairs) a put is about to commit into `node` through its
// PutEnd answer: expect = true before the PutEnd is sent, false once its commits are applied
// or given up. Only a free of such a range that finds no record needs the node to remember it
// (ApplyLocalCommit below). Nothing happens for a node that is not (or no longer) here.
void ExpectLocalCommits(const NodeIdentity& node,
                        std::span<const std::pair<uint64_t, uint64_t>> ranges, bool expect);

// Asks every storage node of this process with this cluster token to heartbeat now rather than
// at its next interval (up to a second away): after a remove, the frees the master queued for
// it come at once, while the caller moves on, instead of landing in the middle of whatever it
// does next.
void HeartbeatLocalNodesNow(const std::string& cluster_token);

// Applies a commit the master returned for a node of this process, with the checks of the
// node's Commit call (the master's term, the node's incarnation, its segments). `sent`: when
// the PutEnd that returned it was sent. A record of a replica the node has been told to free
// since then is left out (its object was removed meanwhile); if the node cannot tell (it no
// longer remembers every free since `sent`) the commit is refused, UNAVAILABLE. A node that
// has stopped: UNAVAILABLE. The commit's records are moved into the node's inventory.
Status ApplyLocalCommit(rpc::CommitRequest& commit, std::chrono::steady_clock::time_point sent);

}  // namespace kvbridge::store
