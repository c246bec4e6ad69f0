#include "store/etcd_client.h"

#include <chrono>
#include <utility>

#include "store/rpc_util.h"

namespace kvbridge::store {

namespace pb = etcdserverpb;

namespace {

// The end of the range of every key that starts with `prefix`: the prefix with its last byte
// incremented (bytes 0xff carried over), as etcd defines prefix ranges.
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    unsigned char c = static_cast<unsigned char>(prefix.back());
    if (c < 0xff) {
      prefix.back() = static_cast<char>(c + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

EtcdKv FromPb(const pb::KeyValue& kv) {
  return EtcdKv{kv.key(), kv.value(), kv.create_revision(), kv.mod_revision(), kv.lease()};
}

// A failure that another member may not have: it is down, slow, or cut off from its quorum.
bool MemberFailure(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

Result<EtcdAddress> ParseEtcdAddress(std::string_view address) {
  std::string_view rest = address;
  if (IsEtcdAddress(rest)) rest.remove_prefix(kEtcdScheme.size());
  EtcdAddress out;
  const size_t slash = rest.find('/');
  if (slash != std::string_view::npos) {
    out.prefix = std::string(rest.substr(slash + 1));
    rest = rest.substr(0, slash);
    if (out.prefix.empty() || out.prefix.find('/') != std::string::npos) {
      return Status::InvalidArgument("etcd address '" + std::string(address) +
                                     "': the cluster prefix after '/' must be one non-empty "
                                     "name without '/'");
    }
  }
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view ep = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (ep.empty()) continue;
    const size_t colon = ep.rfind(':');
    if (colon == std::string_view::npos || colon == 0 || colon + 1 == ep.size() ||
        ep.substr(colon + 1).find_first_not_of("0123456789") != std::string_view::npos) {
      return Status::InvalidArgument("etcd address '" + std::string(address) + "': endpoint '" +
                                     std::string(ep) + "' is not host:port");
    }
    out.endpoints.emplace_back(ep);
  }
  if (out.endpoints.empty()) {
    return Status::InvalidArgument("etcd address '" + std::string(address) +
                                   "' names no endpoint (expected etcd://host:port[,host:port]"
                                   "[/prefix])");
  }
  return out;
}

EtcdClient::EtcdClient(std::vector<std::string> endpoints, uint32_t call_timeout_ms)
    : endpoints_(std::move(endpoints)), call_timeout_ms_(call_timeout_ms) {
  for (const std::string& ep : endpoints_) {
    grpc::ChannelArguments args;
    // A restarted member is reached again within a second, not gRPC's default two minutes.
    // (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is also each connection attempt's timeout: left at
    // gRPC's 20 s, as for the master's channels.)
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    auto channel = NewChannel(ep, args);
    members_.push_back(Member{ep, channel, pb::KV::NewStub(channel), pb::Lease::NewStub(channel)});
  }
}

std::string EtcdClient::Describe() const {
  std::string s = "etcd at ";
  for (size_t i = 0; i < endpoints_.size(); ++i) s += (i ? "," : "") + endpoints_[i];
  return s;
}

template <typename Fn>
Status EtcdClient::OnAnyMember(std::string_view name, Fn&& call) {
  if (members_.empty()) return Status::InvalidArgument("no etcd endpoint configured");
  const size_t first = preferred_.load(std::memory_order_relaxed) % members_.size();
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::milliseconds(call_timeout_ms_);
  // A member whose connection is not up gets a share of the deadline to (re)connect: calls
  // wait for their channel to be ready (a blocking client reconnects only while a call waits),
  // but one dead member must leave time for the others.
  const auto share = std::chrono::milliseconds(
      std::max<uint32_t>(100, call_timeout_ms_ / static_cast<uint32_t>(members_.size())));
  std::string failures;
  for (size_t i = 0; i < members_.size(); ++i) {
    const size_t at = (first + i) % members_.size();
    const auto now = std::chrono::system_clock::now();
    if (now >= deadline) break;
    const bool ready =
        members_[at].channel->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY;
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(ready || i + 1 == members_.size() ? deadline
                                                       : std::min(deadline, now + share));
    grpc::Status s = call(members_[at], &ctx);
    if (s.ok()) {
      preferred_.store(at, std::memory_order_relaxed);
      return Status::OK();
    }
    failures += (failures.empty() ? "" : "; ") + members_[at].endpoint + ": " + s.error_message();
    if (!MemberFailure(s)) {
      return FromGrpc(s, name, StatusOrigin::kMaster, members_[at].endpoint);
    }
  }
  return Status::Unavailable("etcd " + std::string(name) + " failed on every member of " +
                             Describe() + " (" + failures + ")");
}

Result<std::optional<EtcdKv>> EtcdClient::Get(const std::string& key) {
  pb::RangeRequest req;
  req.set_key(key);
  pb::RangeResponse resp;
  Status st = OnAnyMember(
      "Range", [&](Member& m, grpc::ClientContext* ctx) { return m.kv->Range(ctx, req, &resp); });
  if (!st.ok()) return st;
  if (resp.kvs_size() == 0) return std::optional<EtcdKv>();
  return std::optional<EtcdKv>(FromPb(resp.kvs(0)));
}

Result<std::vector<EtcdKv>> EtcdClient::GetPrefix(const std::string& prefix) {
  pb::RangeRequest req;
  req.set_key(prefix);
  req.set_range_end(PrefixEnd(prefix));
  pb::RangeResponse resp;
  Status st = OnAnyMember(
      "Range", [&](Member& m, grpc::ClientContext* ctx) { return m.kv->Range(ctx, req, &resp); });
  if (!st.ok()) return st;
  std::vector<EtcdKv> out;
  out.reserve(resp.kvs_size());
  for (const auto& kv : resp.kvs()) out.push_back(FromPb(kv));
  return out;
}

Result<int64_t> EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  pb::PutRequest req;
  req.set_key(key);
  req.set_value(value);
  req.set_lease(lease);
  pb::PutResponse resp;
  Status st = OnAnyMember(
      "Put", [&](Member& m, grpc::ClientContext* ctx) { return m.kv->Put(ctx, req, &resp); });
  if (!st.ok()) return st;
  return resp.header().revision();
}

Status EtcdClient::Delete(const std::string& key) {
  pb::DeleteRangeRequest req;
  req.set_key(key);
  pb::DeleteRangeResponse resp;
  return OnAnyMember("DeleteRange", [&](Member& m, grpc::ClientContext* ctx) {
    return m.kv->DeleteRange(ctx, req, &resp);
  });
}

Result<EtcdClient::CreateResult> EtcdClient::CreateIfAbsent(const std::string& key,
                                                            const std::string& value,
                                                            int64_t lease) {
  pb::TxnRequest req;
  pb::Compare* c = req.add_compare();
  c->set_result(pb::Compare::EQUAL);
  c->set_target(pb::Compare::CREATE);
  c->set_key(key);
  c->set_create_revision(0);  // the key does not exist
  pb::PutRequest* put = req.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  req.add_failure()->mutable_request_range()->set_key(key);
  pb::TxnResponse resp;
  Status st = OnAnyMember(
      "Txn", [&](Member& m, grpc::ClientContext* ctx) { return m.kv->Txn(ctx, req, &resp); });
  if (!st.ok()) return st;
  CreateResult out;
  out.created = resp.succeeded();
  out.revision = resp.header().revision();
  if (!out.created && resp.responses_size() == 1 &&
      resp.responses(0).response_range().kvs_size() == 1) {
    out.current = FromPb(resp.responses(0).response_range().kvs(0));
  }
  return out;
}

Result<bool> EtcdClient::PutIfUnchanged(const std::string& key, int64_t mod_revision,
                                        const std::string& value) {
  pb::TxnRequest req;
  pb::Compare* c = req.add_compare();
  c->set_result(pb::Compare::EQUAL);
  c->set_target(pb::Compare::MOD);
  c->set_key(key);
  c->set_mod_revision(mod_revision);
  pb::PutRequest* put = req.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  pb::TxnResponse resp;
  Status st = OnAnyMember(
      "Txn", [&](Member& m, grpc::ClientContext* ctx) { return m.kv->Txn(ctx, req, &resp); });
  if (!st.ok()) return st;
  return resp.succeeded();
}

Result<bool> EtcdClient::PutAllWhile(const std::string& guard, int64_t create_revision,
                                     const std::vector<std::pair<std::string, std::string>>& kvs) {
  pb::TxnRequest req;
  pb::Compare* c = req.add_compare();
  c->set_result(pb::Compare::EQUAL);
  c->set_target(pb::Compare::CREATE);
  c->set_key(guard);
  c->set_create_revision(create_revision);
  for (const auto& [k, v] : kvs) {
    pb::PutRequest* put = req.add_success()->mutable_request_put();
    put->set_key(k);
    put->set_value(v);
  }
  pb::TxnResponse resp;
  Status st = OnAnyMember(
      "Txn", [&](Member& m, grpc::ClientContext* ctx) { return m.kv->Txn(ctx, req, &resp); });
  if (!st.ok()) return st;
  return resp.succeeded();
}

Status EtcdClient::DeleteIfCreatedAt(const std::string& key, int64_t create_revision) {
  pb::TxnRequest req;
  pb::Compare* c = req.add_compare();
  c->set_result(pb::Compare::EQUAL);
  c->set_target(pb::Compare::CREATE);
  c->set_key(key);
  c->set_create_revision(create_revision);
  req.add_success()->mutable_request_delete_range()->set_key(key);
  pb::TxnResponse resp;
  return OnAnyMember(
      "Txn", [&](Member& m, grpc::ClientContext* ctx) { return m.kv->Txn(ctx, req, &resp); });
}

Result<EtcdClient::Lease> EtcdClient::GrantLease(int64_t ttl_s) {
  pb::LeaseGrantRequest req;
  req.set_ttl(ttl_s);
  pb::LeaseGrantResponse resp;
  Status st = OnAnyMember("LeaseGrant", [&](Member& m, grpc::ClientContext* ctx) {
    return m.lease->LeaseGrant(ctx, req, &resp);
  });
  if (!st.ok()) return st;
  if (!resp.error().empty()) {
    return Status::Unavailable("etcd LeaseGrant on " + Describe() + ": " + resp.error());
  }
  return Lease{resp.id(), resp.ttl()};
}

Result<int64_t> EtcdClient::KeepAlive(int64_t lease_id) {
  pb::LeaseKeepAliveRequest req;
  req.set_id(lease_id);
  pb::LeaseKeepAliveResponse resp;
  // etcd's keep-alive is a stream; one request and its answer per call keeps every keep-alive
  // under a deadline of its own.
  Status st = OnAnyMember("LeaseKeepAlive", [&](Member& m, grpc::ClientContext* ctx) {
    auto stream = m.lease->LeaseKeepAlive(ctx);
    if (!stream->Write(req) || !stream->Read(&resp)) {
      stream->WritesDone();
      grpc::Status s = stream->Finish();
      return s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "keep-alive stream closed") : s;
    }
    stream->WritesDone();
    ctx->TryCancel();        // the answer is in; do not wait for etcd to close the stream
    (void)stream->Finish();  // CANCELLED at once; a sync stream must be finished
    return grpc::Status::OK;
  });
  if (!st.ok()) return st;
  if (resp.ttl() <= 0) {
    return Status::NotFound("etcd lease " + std::to_string(lease_id) + " has expired");
  }
  return resp.ttl();
}

Status EtcdClient::RevokeLease(int64_t lease_id) {
  pb::LeaseRevokeRequest req;
  req.set_id(lease_id);
  pb::LeaseRevokeResponse resp;
  return OnAnyMember("LeaseRevoke", [&](Member& m, grpc::ClientContext* ctx) {
    return m.lease->LeaseRevoke(ctx, req, &resp);
  });
}

}  // namespace kvbridge::store
