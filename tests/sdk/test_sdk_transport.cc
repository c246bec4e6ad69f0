// The transport half of the plugin SDK (kvbridge/plugin/sdk/transport.hpp), driven through the
// ops table it generates, as a host would: caps follow the members, an absent optional op is the
// ABI's UNSUPPORTED stub and the loader's ValidateDescriptor accepts the table, an exception in
// an op becomes INTERNAL with its text, kvb_plugin_query checks the major and the class's minimum
// host minor, and arrays passed with an element size are read by that size, only as far as each
// field fits. Also loads a plugin built with KVB_TRANSPORT_PLUGIN as a real .so.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/host_services.h"
#include "core/plugin_loader.h"
#include "kvbridge/plugin/sdk/transport.hpp"
#include "tests/sdk/sdk_test_util.h"

namespace kvbridge::plugin::sdk {
namespace {

using testing::FakeHost;

// What the test transport saw, and which op should throw.
struct Record {
  std::string throw_in;
  std::vector<kvb_xfer_op_t> ops;
  std::vector<PeerSegment> segments;
  std::vector<uint8_t> rkey_bytes;  // the copy of each segment's rkey, concatenated
  Region region;
  PostOptions opts;
  int removed = 0;
};
Record g_rec;

void MaybeThrow(const char* op) {
  if (g_rec.throw_in == op) throw std::runtime_error(std::string(op) + " exploded: 42");
}

struct TestPeer {
  std::string node;
};
struct TestRequest {
  uint32_t count;
};

template <bool kWithStats, uint16_t kMinor = 0>
class TestTransport {
 public:
  static constexpr const char* kName = "sdk_test";
  static constexpr const char* kVersion = "9.9";
  static constexpr uint64_t kCaps = KVB_TCAP_READ | KVB_TCAP_HOST_MEM;
  static constexpr uint16_t kMinHostMinor = kMinor;
  using Peer = TestPeer;
  using Request = TestRequest;

  static Status Probe() { return Status(); }
  static Result<std::unique_ptr<TestTransport>> Create(Host host, const kvb_transport_params_t& p) {
    MaybeThrow("create");
    if (p.node_id != nullptr && std::string(p.node_id) == "refuse") {
      return Status(KVB_ERR_INVALID_ARGUMENT, "sdk_test: node id 'refuse' is refused");
    }
    return std::make_unique<TestTransport>();
  }
  std::string Endpoints() {
    MaybeThrow("get_endpoints");
    return "ep:1234";
  }
  Status RegisterMemory(const Region& r, RkeyBuffer& rkey) {
    MaybeThrow("register_memory");
    g_rec.region = r;
    const uint8_t key[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    return rkey.Set(Bytes(key, sizeof(key)));
  }
  Status DeregisterMemory(uint64_t id) {
    return id == 1 ? Status() : Status(KVB_ERR_NOT_FOUND, "segment " + std::to_string(id));
  }
  Result<Peer*> AddPeer(const PeerInfo& info) {
    MaybeThrow("add_peer");
    g_rec.segments.clear();
    g_rec.rkey_bytes.clear();
    for (const PeerSegment& s : info.segments) {
      g_rec.segments.push_back(s);
      g_rec.rkey_bytes.insert(g_rec.rkey_bytes.end(), s.rkey.begin(), s.rkey.end());
    }
    if (info.node_id == "bad") return Status(KVB_ERR_STALE_PEER, "peer 'bad' is stale");
    return new TestPeer{std::string(info.node_id)};
  }
  Status UpdatePeer(Peer*, const PeerInfo&) { return Status(KVB_ERR_INVALID_ARGUMENT, "nope"); }
  void RemovePeer(Peer* p) {
    ++g_rec.removed;
    delete p;
    MaybeThrow("remove_peer");
  }
  Result<Request*> Post(Peer*, const Ops& ops, const PostOptions& opts) {
    MaybeThrow("post");
    g_rec.ops.assign(ops.begin(), ops.end());
    g_rec.opts = opts;
    opts.Complete();
    return new TestRequest{ops.size()};
  }
  Status Poll(Request* r, std::span<kvb_status_t> st) {
    MaybeThrow("poll");
    for (uint32_t i = 0; i < st.size() && i < r->count; ++i) st[i] = KVB_OK;
    return Status();
  }
  void Cancel(Request*) {}
  void Release(Request* r) { delete r; }
  Status Stats(kvb_transport_stats_t& s) requires kWithStats {
    MaybeThrow("get_stats");
    s.connections_open = 11;
    s.queued_bytes = 22;
    return Status();
  }
  uint64_t InstanceCaps() requires kWithStats {
    MaybeThrow("instance_caps");
    return KVB_TCAP_READ;
  }
};

using Plain = TestTransport<false>;
using WithStats = TestTransport<true>;
using Needs1_2 = TestTransport<false, 2>;

const kvb_plugin_descriptor_t* Desc(const kvb_plugin_descriptor_t* d) { return d; }

template <typename P>
const kvb_transport_ops_t* OpsOf() {
  return static_cast<const kvb_transport_ops_t*>(
      TransportPluginQuery<P>(KVB_ABI_MAJOR, KVB_ABI_MINOR)->ops);
}

// One instance of P created through its ops table, destroyed at the end of the scope.
template <typename P>
class Made {
 public:
  explicit Made(const kvb_host_services_t* host) : ops_(OpsOf<P>()) {
    kvb_transport_params_t params{sizeof(params), "n1", 5, nullptr, nullptr};
    char err[256] = "";
    EXPECT_EQ(ops_->create(host, &params, &t_, err, sizeof(err)), KVB_OK) << err;
  }
  ~Made() {
    if (t_ != nullptr) ops_->destroy(t_);
  }
  const kvb_transport_ops_t* ops() const { return ops_; }
  kvb_transport_t* get() const { return t_; }
  kvb_tpeer_t* AddPeer() {
    kvb_peer_info_t info{sizeof(info), "n2", 6, "ep", nullptr, 0, sizeof(kvb_peer_segment_t)};
    kvb_tpeer_t* p = nullptr;
    char err[256] = "";
    EXPECT_EQ(ops_->add_peer(t_, &info, &p, err, sizeof(err)), KVB_OK) << err;
    return p;
  }

 private:
  const kvb_transport_ops_t* ops_;
  kvb_transport_t* t_ = nullptr;
};

class SdkTransport : public ::testing::Test {
 protected:
  void SetUp() override { g_rec = Record(); }
  FakeHost fake_;
};

TEST_F(SdkTransport, CapsFollowTheMembersAndTheLoaderAcceptsTheTable) {
  const kvb_plugin_descriptor_t* plain = TransportPluginQuery<Plain>(1, KVB_ABI_MINOR);
  const kvb_plugin_descriptor_t* stats = TransportPluginQuery<WithStats>(1, KVB_ABI_MINOR);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(stats, nullptr);
  EXPECT_EQ(plain->caps, KVB_TCAP_READ | KVB_TCAP_HOST_MEM);
  EXPECT_EQ(stats->caps, KVB_TCAP_READ | KVB_TCAP_HOST_MEM | KVB_TCAP_STATS);
  EXPECT_STREQ(plain->name, "sdk_test");
  EXPECT_STREQ(plain->version, "9.9");
  EXPECT_EQ(plain->kind, KVB_PLUGIN_TRANSPORT);
  EXPECT_EQ(plain->abi_major, KVB_ABI_MAJOR);
  EXPECT_EQ(plain->abi_minor, KVB_ABI_MINOR);
  EXPECT_EQ(Desc(plain), TransportPluginQuery<Plain>(1, 0)) << "one static descriptor";
  // The loader's own checks: no NULL slot, caps that fit the slots.
  EXPECT_TRUE(core::ValidateDescriptor(plain, "libkvb_transport_sdk_test.so").ok())
      << core::ValidateDescriptor(plain, "x").ToString();
  EXPECT_TRUE(core::ValidateDescriptor(stats, "libkvb_transport_sdk_test.so").ok());
  char reason[64] = "x";
  EXPECT_EQ(plain->probe(reason, sizeof(reason)), KVB_OK);
  EXPECT_STREQ(reason, "");

  // Without Stats() the slot is the ABI's stub; with it, the real op.
  {
    Made<Plain> m(fake_.table());
    kvb_transport_stats_t s{};
    s.struct_size = sizeof(s);
    EXPECT_EQ(m.ops()->get_stats(m.get(), &s), KVB_ERR_UNSUPPORTED);
  }
  Made<WithStats> m(fake_.table());
  kvb_transport_stats_t s{};
  s.struct_size = sizeof(s);
  ASSERT_EQ(m.ops()->get_stats(m.get(), &s), KVB_OK);
  EXPECT_EQ(s.connections_open, 11u);
  EXPECT_EQ(s.queued_bytes, 22u);
  EXPECT_EQ(s.struct_size, sizeof(s));
  // An older host's smaller stats struct: only what fits is written.
  struct {
    kvb_transport_stats_t s;
  } small;
  std::memset(&small, 0xee, sizeof(small));
  small.s.struct_size = offsetof(kvb_transport_stats_t, connections_opened);
  ASSERT_EQ(m.ops()->get_stats(m.get(), &small.s), KVB_OK);
  EXPECT_EQ(small.s.connections_open, 11u);
  EXPECT_EQ(small.s.queued_bytes, 0xeeeeeeeeeeeeeeeeu) << "wrote past the host's struct_size";
  EXPECT_EQ(small.s.struct_size, offsetof(kvb_transport_stats_t, connections_opened));
}

// instance_caps (ABI 1.3): the ABI's all-bits stub without InstanceCaps(); the member's answer
// with it; all bits (the descriptor's caps stand) when the member throws.
TEST_F(SdkTransport, InstanceCapsFollowTheMember) {
  {
    Made<Plain> m(fake_.table());
    EXPECT_EQ(m.ops()->instance_caps, &kvb_transport_instance_caps_all);
    EXPECT_EQ(m.ops()->instance_caps(m.get()), ~uint64_t{0});
  }
  Made<WithStats> m(fake_.table());
  EXPECT_EQ(m.ops()->instance_caps(m.get()), KVB_TCAP_READ);
  g_rec.throw_in = "instance_caps";
  EXPECT_EQ(m.ops()->instance_caps(m.get()), ~uint64_t{0});
  g_rec.throw_in.clear();
}

TEST_F(SdkTransport, QueryRefusesAnotherMajorAndATooOldMinor) {
  EXPECT_EQ(TransportPluginQuery<Plain>(KVB_ABI_MAJOR + 1, 0), nullptr);
  EXPECT_EQ(TransportPluginQuery<Plain>(0, KVB_ABI_MINOR), nullptr);
  EXPECT_NE(TransportPluginQuery<Plain>(KVB_ABI_MAJOR, 0), nullptr);
  EXPECT_EQ(TransportPluginQuery<Needs1_2>(KVB_ABI_MAJOR, 0), nullptr);
  EXPECT_EQ(TransportPluginQuery<Needs1_2>(KVB_ABI_MAJOR, 1), nullptr);
  EXPECT_NE(TransportPluginQuery<Needs1_2>(KVB_ABI_MAJOR, 2), nullptr);
  EXPECT_NE(TransportPluginQuery<Needs1_2>(KVB_ABI_MAJOR, 3), nullptr);
}

TEST_F(SdkTransport, AnExceptionInAnOpIsInternalWithItsText) {
  const kvb_transport_ops_t* ops = OpsOf<Plain>();
  char err[256] = "";
  kvb_transport_params_t params{sizeof(params), "n1", 5, nullptr, nullptr};
  kvb_transport_t* t = reinterpret_cast<kvb_transport_t*>(0x1);
  g_rec.throw_in = "create";
  EXPECT_EQ(ops->create(fake_.table(), &params, &t, err, sizeof(err)), KVB_ERR_INTERNAL);
  EXPECT_HAS(err, "sdk_test: internal error in create: create exploded: 42");
  EXPECT_EQ(t, reinterpret_cast<kvb_transport_t*>(0x1)) << "*out touched on failure";
  g_rec.throw_in.clear();

  Made<Plain> m(fake_.table());
  kvb_tpeer_t* peer = m.AddPeer();
  ASSERT_NE(peer, nullptr);
  kvb_xfer_op_t op{KVB_OP_READ, 0, 1, nullptr, 8, 2, 0, nullptr};
  kvb_treq_t* req = nullptr;
  g_rec.throw_in = "post";
  EXPECT_EQ(ops->post(m.get(), peer, &op, sizeof(op), 1, nullptr, &req, err, sizeof(err)),
            KVB_ERR_INTERNAL);
  EXPECT_HAS(err, "post exploded: 42");
  EXPECT_EQ(req, nullptr);

  // Ops without an err buffer: INTERNAL, and the text goes to the host's log.
  g_rec.throw_in = "register_memory";
  int buf = 0;
  kvb_region_t r{sizeof(r), KVB_MEM_HOST, 1, &buf, sizeof(buf), -1};
  uint8_t rkey[16];
  uint32_t rkey_len = 99;
  EXPECT_EQ(ops->register_memory(m.get(), &r, rkey, sizeof(rkey), &rkey_len), KVB_ERR_INTERNAL);
  EXPECT_HAS(fake_.AllLogs(),
             "sdk_test: internal error in register_memory: register_memory exploded: 42");
  g_rec.throw_in = "get_endpoints";
  char ep[64];
  EXPECT_EQ(ops->get_endpoints(m.get(), ep, sizeof(ep)), -2);
  EXPECT_HAS(fake_.AllLogs(), "get_endpoints exploded: 42");
  // A void op cannot report it; it is logged and does not escape.
  g_rec.throw_in = "remove_peer";
  ops->remove_peer(m.get(), peer);
  EXPECT_EQ(g_rec.removed, 1);
  EXPECT_HAS(fake_.AllLogs(), "internal error in remove_peer: remove_peer exploded: 42");
}

TEST_F(SdkTransport, ErrorsAndNullArgumentsReachTheHost) {
  Made<Plain> m(fake_.table());
  const kvb_transport_ops_t* ops = m.ops();
  char err[256] = "";
  kvb_transport_params_t params{sizeof(params), "refuse", 5, nullptr, nullptr};
  kvb_transport_t* t = nullptr;
  EXPECT_EQ(ops->create(fake_.table(), &params, &t, err, sizeof(err)), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "sdk_test: node id 'refuse' is refused");
  EXPECT_EQ(ops->create(fake_.table(), &params, nullptr, err, sizeof(err)),
            KVB_ERR_INVALID_ARGUMENT);
  EXPECT_HAS(err, "params or out is NULL");

  kvb_peer_info_t bad{sizeof(bad), "bad", 6, "ep", nullptr, 0, sizeof(kvb_peer_segment_t)};
  kvb_tpeer_t* p = nullptr;
  EXPECT_EQ(ops->add_peer(m.get(), &bad, &p, err, sizeof(err)), KVB_ERR_STALE_PEER);
  EXPECT_STREQ(err, "peer 'bad' is stale");
  EXPECT_EQ(p, nullptr);
  EXPECT_EQ(ops->add_peer(m.get(), nullptr, &p, err, sizeof(err)), KVB_ERR_INVALID_ARGUMENT);
  kvb_tpeer_t* peer = m.AddPeer();
  EXPECT_EQ(ops->update_peer(m.get(), peer, &bad, err, sizeof(err)), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "nope");
  EXPECT_EQ(ops->deregister_memory(m.get(), 1), KVB_OK);
  EXPECT_EQ(ops->deregister_memory(m.get(), 2), KVB_ERR_NOT_FOUND);
  kvb_treq_t* req = nullptr;
  EXPECT_EQ(
      ops->post(m.get(), peer, nullptr, sizeof(kvb_xfer_op_t), 1, nullptr, &req, err, sizeof(err)),
      KVB_ERR_INVALID_ARGUMENT);

  // get_endpoints: the length, or -2 with the buffer untouched when it is too small.
  char ep[8];
  EXPECT_EQ(ops->get_endpoints(m.get(), ep, sizeof(ep)), 7);
  EXPECT_STREQ(ep, "ep:1234");
  char tiny[7] = "zzzzzz";
  EXPECT_EQ(ops->get_endpoints(m.get(), tiny, sizeof(tiny)), -2);
  EXPECT_STREQ(tiny, "zzzzzz");

  // An rkey that does not fit the host's buffer: INVALID_ARGUMENT, nothing written.
  int buf = 0;
  kvb_region_t r{sizeof(r), KVB_MEM_HOST, 1, &buf, sizeof(buf), 3};
  uint8_t rkey[8] = {0};
  uint32_t rkey_len = 99;
  EXPECT_EQ(ops->register_memory(m.get(), &r, rkey, 4, &rkey_len), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(rkey_len, 0u);
  EXPECT_EQ(rkey[0], 0);
  EXPECT_HAS(fake_.AllLogs(), "rkey of 8 bytes does not fit the host's buffer of 4");
  EXPECT_EQ(ops->register_memory(m.get(), &r, rkey, sizeof(rkey), &rkey_len), KVB_OK);
  EXPECT_EQ(rkey_len, 8u);
  EXPECT_EQ(rkey[7], 8);
  EXPECT_EQ(g_rec.region.device_id, 3);
  ops->remove_peer(m.get(), peer);
}

// Ops laid out `stride` bytes apart, each filled from `op` as far as the stride holds it, the
// rest of each element 0xab (bytes a newer host would use, or an older host's next element).
std::vector<uint8_t> LayOut(const std::vector<kvb_xfer_op_t>& ops, size_t stride) {
  std::vector<uint8_t> out(ops.size() * stride + 64, 0xab);
  for (size_t i = 0; i < ops.size(); ++i) {
    std::memcpy(out.data() + i * stride, &ops[i], std::min(stride, sizeof(kvb_xfer_op_t)));
  }
  return out;
}

TEST_F(SdkTransport, OpsAreReadByOpSizeAndOnlyAsFarAsEachFieldFits) {
  Made<Plain> m(fake_.table());
  kvb_tpeer_t* peer = m.AddPeer();
  int a = 0, b = 0;
  kvb_op_crc_t slot{};
  const std::vector<kvb_xfer_op_t> ops = {{KVB_OP_READ, KVB_XOP_CRC32C, 1, &a, 10, 2, 100, &slot},
                                          {KVB_OP_WRITE, 0, 3, &b, 20, 4, 200, nullptr}};
  char err[256] = "";
  kvb_treq_t* req = nullptr;
  int completions = 0;
  kvb_post_opts_t opts{sizeof(opts), 777, 888, [](void* u) { ++*static_cast<int*>(u); },
                       &completions};

  // Larger elements (a newer host): stepped by op_size, the extra bytes ignored.
  const size_t larger = sizeof(kvb_xfer_op_t) + 24;
  auto bytes = LayOut(ops, larger);
  ASSERT_EQ(m.ops()->post(m.get(), peer, reinterpret_cast<kvb_xfer_op_t*>(bytes.data()), larger, 2,
                          &opts, &req, err, sizeof(err)),
            KVB_OK)
      << err;
  ASSERT_EQ(g_rec.ops.size(), 2u);
  EXPECT_EQ(g_rec.ops[1].opcode, static_cast<uint32_t>(KVB_OP_WRITE));
  EXPECT_EQ(g_rec.ops[1].local_segment, 3u);
  EXPECT_EQ(g_rec.ops[1].local_addr, &b);
  EXPECT_EQ(g_rec.ops[1].length, 20u);
  EXPECT_EQ(g_rec.ops[1].remote_segment, 4u);
  EXPECT_EQ(g_rec.ops[1].remote_offset, 200u);
  EXPECT_EQ(g_rec.ops[0].flags, KVB_XOP_CRC32C);  // 1.4's fields, as the host wrote them
  EXPECT_EQ(g_rec.ops[0].crc, &slot);
  EXPECT_EQ(g_rec.opts.deadline_ns, 777u);
  EXPECT_EQ(g_rec.opts.progress_timeout_ns, 888u);
  EXPECT_EQ(completions, 1);
  kvb_status_t st[2] = {KVB_IN_PROGRESS, KVB_IN_PROGRESS};
  EXPECT_EQ(m.ops()->poll(m.get(), req, st, 2, err, sizeof(err)), KVB_OK);
  EXPECT_EQ(st[1], KVB_OK);
  m.ops()->release(m.get(), req);

  // A 1.0-1.3 host's elements end before `crc`: it reads as null, not as the 0xab that follow.
  bytes = LayOut(ops, KVB_XFER_OP_SIZE_1_0);
  ASSERT_EQ(m.ops()->post(m.get(), peer, reinterpret_cast<kvb_xfer_op_t*>(bytes.data()),
                          KVB_XFER_OP_SIZE_1_0, 2, &opts, &req, err, sizeof(err)),
            KVB_OK)
      << err;
  ASSERT_EQ(g_rec.ops.size(), 2u);
  EXPECT_EQ(g_rec.ops[0].crc, nullptr);
  EXPECT_EQ(g_rec.ops[1].crc, nullptr);
  EXPECT_EQ(g_rec.ops[1].remote_offset, 200u);
  EXPECT_EQ(completions, 2);
  m.ops()->release(m.get(), req);

  // Smaller elements (ending inside remote_offset): the cut field reads as 0, not as the next
  // element's bytes.
  const size_t smaller = offsetof(kvb_xfer_op_t, remote_offset) + 4;
  bytes = LayOut(ops, smaller);
  // Options of a host whose struct ends before on_complete: no callback is read.
  kvb_post_opts_t short_opts = opts;
  short_opts.struct_size = offsetof(kvb_post_opts_t, on_complete);
  ASSERT_EQ(m.ops()->post(m.get(), peer, reinterpret_cast<kvb_xfer_op_t*>(bytes.data()), smaller, 2,
                          &short_opts, &req, err, sizeof(err)),
            KVB_OK);
  ASSERT_EQ(g_rec.ops.size(), 2u);
  EXPECT_EQ(g_rec.ops[0].remote_segment, 2u);
  EXPECT_EQ(g_rec.ops[0].remote_offset, 0u);
  EXPECT_EQ(g_rec.ops[1].opcode, static_cast<uint32_t>(KVB_OP_WRITE));
  EXPECT_EQ(g_rec.ops[1].local_addr, &b);
  EXPECT_EQ(g_rec.ops[1].remote_segment, 4u);
  EXPECT_EQ(g_rec.ops[1].remote_offset, 0u);
  EXPECT_EQ(g_rec.opts.on_complete, nullptr);
  EXPECT_EQ(g_rec.opts.deadline_ns, 777u);
  EXPECT_EQ(completions, 2);
  m.ops()->release(m.get(), req);
  m.ops()->remove_peer(m.get(), peer);
}

TEST_F(SdkTransport, PeerSegmentsAreReadBySegmentSizeAndTheirOwnStructSize) {
  Made<Plain> m(fake_.table());
  const uint8_t k1[] = {0xa1, 0xa2}, k2[] = {0xb1, 0xb2, 0xb3};
  kvb_peer_segment_t segs[2] = {
      {sizeof(kvb_peer_segment_t), KVB_MEM_HOST, 10, 1000, k1, sizeof(k1)},
      {sizeof(kvb_peer_segment_t), KVB_MEM_HOST, 11, 1100, k2, sizeof(k2)}};
  auto lay = [&](size_t stride) {
    std::vector<uint8_t> out(2 * stride + 64, 0xab);
    for (int i = 0; i < 2; ++i) {
      std::memcpy(out.data() + i * stride, &segs[i], std::min(stride, sizeof(segs[i])));
    }
    return out;
  };
  auto add = [&](const std::vector<uint8_t>& bytes, size_t stride) {
    kvb_peer_info_t info{sizeof(info),
                         "n2",
                         6,
                         "ep",
                         reinterpret_cast<const kvb_peer_segment_t*>(bytes.data()),
                         2,
                         static_cast<uint32_t>(stride)};
    kvb_tpeer_t* p = nullptr;
    char err[256] = "";
    ASSERT_EQ(m.ops()->add_peer(m.get(), &info, &p, err, sizeof(err)), KVB_OK) << err;
    m.ops()->remove_peer(m.get(), p);
  };

  // Larger elements: stepped by segment_size.
  const size_t larger = sizeof(kvb_peer_segment_t) + 16;
  add(lay(larger), larger);
  ASSERT_EQ(g_rec.segments.size(), 2u);
  EXPECT_EQ(g_rec.segments[1].segment_id, 11u);
  EXPECT_EQ(g_rec.segments[1].length, 1100u);
  EXPECT_EQ(g_rec.rkey_bytes, std::vector<uint8_t>({0xa1, 0xa2, 0xb1, 0xb2, 0xb3}));

  // Smaller elements that end before the rkey: no rkey, and the next element read at its place.
  const size_t smaller = offsetof(kvb_peer_segment_t, rkey);
  for (auto& s : segs) s.struct_size = static_cast<uint32_t>(smaller);
  add(lay(smaller), smaller);
  ASSERT_EQ(g_rec.segments.size(), 2u);
  EXPECT_EQ(g_rec.segments[1].segment_id, 11u);
  EXPECT_EQ(g_rec.segments[1].length, 1100u);
  EXPECT_TRUE(g_rec.rkey_bytes.empty());

  // Full-size stride but an element whose own struct_size ends before length: length is 0.
  segs[0].struct_size = offsetof(kvb_peer_segment_t, length);
  segs[1].struct_size = sizeof(kvb_peer_segment_t);
  add(lay(sizeof(kvb_peer_segment_t)), sizeof(kvb_peer_segment_t));
  EXPECT_EQ(g_rec.segments[0].segment_id, 10u);
  EXPECT_EQ(g_rec.segments[0].length, 0u);
  EXPECT_TRUE(g_rec.segments[0].rkey.empty());
  EXPECT_EQ(g_rec.segments[1].length, 1100u);
}

TEST_F(SdkTransport, RegionFieldsBeyondStructSizeKeepTheirDefaults) {
  Made<Plain> m(fake_.table());
  int buf = 0;
  kvb_region_t r{offsetof(kvb_region_t, device_id), KVB_MEM_HOST, 7, &buf, sizeof(buf), 5, nullptr};
  uint8_t rkey[8];
  uint32_t rkey_len = 0;
  ASSERT_EQ(m.ops()->register_memory(m.get(), &r, rkey, sizeof(rkey), &rkey_len), KVB_OK);
  EXPECT_EQ(g_rec.region.segment_id, 7u);
  EXPECT_EQ(g_rec.region.addr, &buf);
  EXPECT_EQ(g_rec.region.length, sizeof(buf));
  EXPECT_EQ(g_rec.region.device_id, -1) << "read device_id beyond struct_size";
  EXPECT_EQ(g_rec.region.raw, &r);
}

// ABI 1.5: a region's reg_flags reach the plugin when the host's struct covers them, and
// MarkLocalOnly sets KVB_REG_LOCAL_ONLY there; a 1.4 host's region (no reg_flags) says it
// cannot keep a key local, and marking it writes nothing.
TEST_F(SdkTransport, RegionRegFlagsAreTheHostsWhenItOffersThem) {
  Made<Plain> m(fake_.table());
  int buf = 0;
  uint32_t flags = 0;
  kvb_region_t r{sizeof(r), KVB_MEM_HOST, 7, &buf, sizeof(buf), -1, &flags};
  uint8_t rkey[8];
  uint32_t rkey_len = 0;
  ASSERT_EQ(m.ops()->register_memory(m.get(), &r, rkey, sizeof(rkey), &rkey_len), KVB_OK);
  EXPECT_TRUE(g_rec.region.CanBeLocalOnly());
  g_rec.region.MarkLocalOnly();
  EXPECT_EQ(flags, KVB_REG_LOCAL_ONLY);

  flags = 0;
  r.struct_size = offsetof(kvb_region_t, reg_flags);
  ASSERT_EQ(m.ops()->register_memory(m.get(), &r, rkey, sizeof(rkey), &rkey_len), KVB_OK);
  EXPECT_FALSE(g_rec.region.CanBeLocalOnly()) << "read reg_flags beyond struct_size";
  g_rec.region.MarkLocalOnly();
  EXPECT_EQ(flags, 0u);
}

// A plugin built with KVB_TRANSPORT_PLUGIN as its own .so (sdk_test_plugin.cc), through the real
// loader: the one exported symbol works and the host drives it.
TEST(SdkTransportPlugin, LoadsThroughTheRegistry) {
  core::PluginRegistry reg;
  const core::PluginInfo& info =
      reg.LoadFile(std::string(KVBRIDGE_SDK_TEST_PLUGIN_DIR) + "/libkvb_transport_sdk_echo.so");
  ASSERT_EQ(info.state, core::PluginState::kLoaded) << info.reason;
  EXPECT_EQ(info.name, "sdk_echo");
  EXPECT_EQ(info.caps, KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM | KVB_TCAP_STATS);
  const kvb_transport_ops_t* ops = info.transport_ops();
  ASSERT_NE(ops, nullptr);
  core::HostServices host(std::map<std::string, std::string>{{"sdk_echo.greeting", "hi"}});
  kvb_transport_params_t params{sizeof(params), "n1", 5, nullptr, nullptr};
  kvb_transport_t* t = nullptr;
  char err[256] = "";
  ASSERT_EQ(ops->create(host.table(), &params, &t, err, sizeof(err)), KVB_OK) << err;
  char ep[64];
  ASSERT_GT(ops->get_endpoints(t, ep, sizeof(ep)), 0);
  EXPECT_STREQ(ep, "hi:n1");  // built from the config key and params
  kvb_transport_stats_t s{};
  s.struct_size = sizeof(s);
  EXPECT_EQ(ops->get_stats(t, &s), KVB_OK);
  EXPECT_EQ(s.connections_open, 1u);
  ops->destroy(t);
}

}  // namespace
}  // namespace kvbridge::plugin::sdk
