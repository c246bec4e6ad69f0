// kvbridge plugin SDK for transports: a transport plugin written as a C++ class, and
// KVB_TRANSPORT_PLUGIN(Class), which turns it into the C ABI of transport.h (the descriptor,
// the ops table of trampolines, and the exported kvb_plugin_query).
//
// The class (see examples/transport_plugin/ for a whole one):
//
//   class MyTransport {
//    public:
//     static constexpr const char* kName = "my";       // [a-z0-9_]{1,64}, the file's <name>
//     static constexpr const char* kVersion = "1.0";
//     static constexpr uint64_t kCaps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM;
//     static constexpr uint16_t kMinHostMinor = 0;     // optional: refuse older hosts
//     using Peer = ...;  using Request = ...;          // what the opaque handles point at
//     static sdk::Status Probe();                      // optional: OK when absent
//     static sdk::Result<std::unique_ptr<MyTransport>> Create(sdk::Host,
//                                                             const kvb_transport_params_t&);
//     std::string Endpoints();
//     sdk::Status RegisterMemory(const sdk::Region&, sdk::RkeyBuffer&);
//     sdk::Status DeregisterMemory(uint64_t segment_id);
//     sdk::Result<Peer*> AddPeer(const sdk::PeerInfo&);
//     sdk::Status UpdatePeer(Peer*, const sdk::PeerInfo&);
//     void RemovePeer(Peer*);                          // frees the peer
//     sdk::Result<Request*> Post(Peer*, const sdk::Ops&, const sdk::PostOptions&);
//     sdk::Status Poll(Request*, std::span<kvb_status_t> op_status);
//     void Cancel(Request*);
//     void Release(Request*);                          // frees the request
//     sdk::Status Stats(kvb_transport_stats_t&);       // optional: adds KVB_TCAP_STATS
//     uint64_t InstanceCaps();                         // optional (ABI 1.3): the caps this
//                                                      // instance has; the host keeps only
//                                                      // those of kCaps among them
//   };
//   KVB_TRANSPORT_PLUGIN(MyTransport)
//
// Every trampoline checks the ABI's pointers (a NULL out or info is INVALID_ARGUMENT), runs the
// member inside detail::Guard (an exception becomes KVB_ERR_INTERNAL with its text), and copies
// messages into the host's err buffers. get_stats points to the ABI's UNSUPPORTED stub unless the
// class has Stats(). Arrays passed with an element size are read through sdk::Ops and
// sdk::PeerSegments, which step by that size and read only the fields that fit.
//
// Thread-safety: the trampolines add no locking; the ABI's rules (transport.h) apply to the
// class's members unchanged: all may run concurrently except the destructor (destroy).
#pragma once

#include <cstddef>
#include <cstring>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvbridge/plugin/sdk/common.hpp"
#include "kvbridge/plugin/transport.h"

namespace kvbridge::plugin::sdk {

// A view of `count` elements `stride` bytes apart, each read by Read(ptr, stride) into an
// Elem value that holds only the fields the stride covers (the rest keep their defaults). A
// host built against a newer minor may pass larger elements; an older one smaller.
template <typename Elem, Elem (*Read)(const uint8_t*, size_t)>
class StridedView {
 public:
  StridedView() = default;
  StridedView(const void* data, uint32_t count, uint32_t stride)
      : data_(static_cast<const uint8_t*>(data)),
        count_(data == nullptr ? 0 : count),
        stride_(stride) {}

  uint32_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  uint32_t stride() const { return stride_; }
  const void* data() const { return data_; }
  Elem operator[](uint32_t i) const {
    return Read(data_ + static_cast<size_t>(i) * stride_, stride_);
  }

  // An input iterator yielding Elem values.
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Elem;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = Elem;

    iterator() = default;
    iterator(const StridedView* v, uint32_t i) : v_(v), i_(i) {}
    Elem operator*() const { return (*v_)[i_]; }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    iterator operator++(int) {
      iterator old = *this;
      ++i_;
      return old;
    }
    bool operator==(const iterator& o) const { return i_ == o.i_; }

   private:
    const StridedView* v_ = nullptr;
    uint32_t i_ = 0;
  };
  iterator begin() const { return iterator(this, 0); }
  iterator end() const { return iterator(this, count_); }

 private:
  const uint8_t* data_ = nullptr;
  uint32_t count_ = 0;
  uint32_t stride_ = 0;
};

namespace detail {

inline kvb_xfer_op_t ReadOp(const uint8_t* p, size_t avail) {
  kvb_xfer_op_t op{};
  KVB_SDK_READ_FIELD(op, p, avail, kvb_xfer_op_t, opcode);
  KVB_SDK_READ_FIELD(op, p, avail, kvb_xfer_op_t, flags);
  KVB_SDK_READ_FIELD(op, p, avail, kvb_xfer_op_t, local_segment);
  KVB_SDK_READ_FIELD(op, p, avail, kvb_xfer_op_t, local_addr);
  KVB_SDK_READ_FIELD(op, p, avail, kvb_xfer_op_t, length);
  KVB_SDK_READ_FIELD(op, p, avail, kvb_xfer_op_t, remote_segment);
  KVB_SDK_READ_FIELD(op, p, avail, kvb_xfer_op_t, remote_offset);
  KVB_SDK_READ_FIELD(op, p, avail, kvb_xfer_op_t, crc);  // 1.4
  return op;
}

}  // namespace detail

// One remote segment of a peer, as far as the host's element holds it.
struct PeerSegment {
  uint32_t mem_kind = 0;
  uint64_t segment_id = 0;
  uint64_t length = 0;
  Bytes rkey;  // empty when absent
};

namespace detail {

inline PeerSegment ReadSegment(const uint8_t* p, size_t stride) {
  kvb_peer_segment_t s{};
  KVB_SDK_READ_FIELD(s, p, stride, kvb_peer_segment_t, struct_size);
  // The element's own struct_size says what the host filled; the stride what we may read.
  const size_t avail = s.struct_size < stride ? s.struct_size : stride;
  KVB_SDK_READ_FIELD(s, p, avail, kvb_peer_segment_t, mem_kind);
  KVB_SDK_READ_FIELD(s, p, avail, kvb_peer_segment_t, segment_id);
  KVB_SDK_READ_FIELD(s, p, avail, kvb_peer_segment_t, length);
  KVB_SDK_READ_FIELD(s, p, avail, kvb_peer_segment_t, rkey);
  KVB_SDK_READ_FIELD(s, p, avail, kvb_peer_segment_t, rkey_len);
  PeerSegment out;
  out.mem_kind = s.mem_kind;
  out.segment_id = s.segment_id;
  out.length = s.length;
  if (s.rkey != nullptr) out.rkey = Bytes(s.rkey, s.rkey_len);
  return out;
}

}  // namespace detail

// post()'s ops, stepped by op_size: ops[i] is a kvb_xfer_op_t whose fields beyond op_size are 0.
using Ops = StridedView<kvb_xfer_op_t, detail::ReadOp>;
// A peer's segments, stepped by segment_size.
using PeerSegments = StridedView<PeerSegment, detail::ReadSegment>;

// register_memory()'s region, fields beyond its struct_size at their defaults.
struct Region {
  uint32_t mem_kind = 0;
  uint64_t segment_id = 0;
  void* addr = nullptr;
  uint64_t length = 0;
  int32_t device_id = -1;
  uint32_t* reg_flags = nullptr;      // 1.5: null on a host that takes no KVB_REG_* bits
  const kvb_region_t* raw = nullptr;  // for a backend that takes the ABI struct

  // 1.5: whether the host can keep this region's key to itself (KVB_REG_LOCAL_ONLY).
  bool CanBeLocalOnly() const { return reg_flags != nullptr; }
  // Marks the region as one peers cannot reach over this transport (only when CanBeLocalOnly).
  void MarkLocalOnly() const {
    if (reg_flags != nullptr) *reg_flags |= KVB_REG_LOCAL_ONLY;
  }

  static Region From(const kvb_region_t* r) {
    Region out;
    out.raw = r;
    if (r == nullptr) return out;
    const size_t avail = r->struct_size;
    const auto* p = reinterpret_cast<const uint8_t*>(r);
    KVB_SDK_READ_FIELD(out, p, avail, kvb_region_t, mem_kind);
    KVB_SDK_READ_FIELD(out, p, avail, kvb_region_t, segment_id);
    KVB_SDK_READ_FIELD(out, p, avail, kvb_region_t, addr);
    KVB_SDK_READ_FIELD(out, p, avail, kvb_region_t, length);
    KVB_SDK_READ_FIELD(out, p, avail, kvb_region_t, device_id);
    KVB_SDK_READ_FIELD(out, p, avail, kvb_region_t, reg_flags);
    return out;
  }
};

// add_peer()/update_peer()'s peer, fields beyond its struct_size at their defaults.
struct PeerInfo {
  std::string_view node_id;
  uint64_t incarnation = 0;
  std::string_view endpoints;
  PeerSegments segments;
  const kvb_peer_info_t* raw = nullptr;

  static PeerInfo From(const kvb_peer_info_t* info) {
    PeerInfo out;
    out.raw = info;
    kvb_peer_info_t i{};
    const auto* p = reinterpret_cast<const uint8_t*>(info);
    const size_t avail = info->struct_size;
    KVB_SDK_READ_FIELD(i, p, avail, kvb_peer_info_t, node_id);
    KVB_SDK_READ_FIELD(i, p, avail, kvb_peer_info_t, incarnation);
    KVB_SDK_READ_FIELD(i, p, avail, kvb_peer_info_t, endpoints);
    KVB_SDK_READ_FIELD(i, p, avail, kvb_peer_info_t, segments);
    KVB_SDK_READ_FIELD(i, p, avail, kvb_peer_info_t, num_segments);
    KVB_SDK_READ_FIELD(i, p, avail, kvb_peer_info_t, segment_size);
    if (i.node_id != nullptr) out.node_id = i.node_id;
    out.incarnation = i.incarnation;
    if (i.endpoints != nullptr) out.endpoints = i.endpoints;
    if (i.segment_size != 0)
      out.segments = PeerSegments(i.segments, i.num_segments, i.segment_size);
    return out;
  }
};

// post()'s options (opts may be NULL: no deadline, the transport's progress timeout, no
// callback).
struct PostOptions {
  uint64_t deadline_ns = 0;
  uint64_t progress_timeout_ns = 0;
  void (*on_complete)(void* user) = nullptr;
  void* user = nullptr;
  const kvb_post_opts_t* raw = nullptr;

  // Calls on_complete once, if there is one (the request just became final).
  void Complete() const {
    if (on_complete != nullptr) on_complete(user);
  }

  static PostOptions From(const kvb_post_opts_t* o) {
    PostOptions out;
    out.raw = o;
    if (o == nullptr) return out;
    kvb_post_opts_t v{};
    const auto* p = reinterpret_cast<const uint8_t*>(o);
    const size_t avail = o->struct_size;
    KVB_SDK_READ_FIELD(v, p, avail, kvb_post_opts_t, deadline_ns);
    KVB_SDK_READ_FIELD(v, p, avail, kvb_post_opts_t, progress_timeout_ns);
    KVB_SDK_READ_FIELD(v, p, avail, kvb_post_opts_t, on_complete);
    KVB_SDK_READ_FIELD(v, p, avail, kvb_post_opts_t, user);
    out.deadline_ns = v.deadline_ns;
    out.progress_timeout_ns = v.progress_timeout_ns;
    out.on_complete = v.on_complete;
    out.user = v.user;
    return out;
  }
};

// register_memory()'s rkey output. Starts empty (*rkey_len = 0); Set() checks the host's room
// before the region is committed anywhere.
class RkeyBuffer {
 public:
  RkeyBuffer(uint8_t* buf, uint32_t cap, uint32_t* len) : buf_(buf), cap_(cap), len_(len) {
    if (len_ != nullptr) *len_ = 0;
  }
  uint32_t capacity() const { return buf_ == nullptr ? 0 : cap_; }
  // INVALID_ARGUMENT (nothing written) when the key does not fit.
  Status Set(Bytes key) {
    if (key.size() > capacity() || (len_ == nullptr && !key.empty())) {
      return Status(KVB_ERR_INVALID_ARGUMENT, "rkey of " + std::to_string(key.size()) +
                                                  " bytes does not fit the host's buffer of " +
                                                  std::to_string(capacity()));
    }
    if (!key.empty()) std::memcpy(buf_, key.data(), key.size());
    if (len_ != nullptr) *len_ = static_cast<uint32_t>(key.size());
    return Status();
  }

 private:
  uint8_t* buf_;
  uint32_t cap_;
  uint32_t* len_;
};

namespace detail {

template <typename P>
concept HasTransportStats = requires(P& p, kvb_transport_stats_t& s) {
  { p.Stats(s) } -> std::convertible_to<Status>;
};

template <typename P>
concept HasInstanceCaps = requires(P& p) {
  { p.InstanceCaps() } -> std::convertible_to<uint64_t>;
};

// The required members, each checked on its own so the compile error names the one missing.
template <typename P>
constexpr bool CheckTransportClass() {
  CheckIdentity<P>();
  static_assert(
      requires {
        { P::kCaps } -> std::convertible_to<uint64_t>;
      },
      "a transport class needs `static constexpr uint64_t kCaps`");
  static_assert((P::kCaps & (KVB_TCAP_READ | KVB_TCAP_WRITE)) != 0,
                "transport kCaps must hold KVB_TCAP_READ or KVB_TCAP_WRITE");
  static_assert((P::kCaps & (KVB_TCAP_HOST_MEM | KVB_TCAP_CUDA_MEM)) != 0,
                "transport kCaps must hold KVB_TCAP_HOST_MEM or KVB_TCAP_CUDA_MEM");
  static_assert((P::kCaps & KVB_TCAP_STATS) == 0 || HasTransportStats<P>,
                "kCaps holds KVB_TCAP_STATS but the class has no Stats(kvb_transport_stats_t&)");
  static_assert(
      requires {
        typename P::Peer;
        typename P::Request;
      },
      "a transport class needs `using Peer = ...; using Request = ...;`");
  static_assert(
      requires(Host h, const kvb_transport_params_t& params) {
        { P::Create(h, params) } -> std::same_as<Result<std::unique_ptr<P>>>;
      },
      "needs static Result<std::unique_ptr<Self>> Create(sdk::Host, const "
      "kvb_transport_params_t&)");
  static_assert(
      requires(P & p) {
        { p.Endpoints() } -> std::convertible_to<std::string>;
      },
      "needs std::string Endpoints()");
  static_assert(
      requires(P & p, const Region& r, RkeyBuffer& k) {
        { p.RegisterMemory(r, k) } -> std::convertible_to<Status>;
      },
      "needs Status RegisterMemory(const sdk::Region&, sdk::RkeyBuffer&)");
  static_assert(
      requires(P & p) {
        { p.DeregisterMemory(uint64_t{}) } -> std::convertible_to<Status>;
      },
      "needs Status DeregisterMemory(uint64_t)");
  static_assert(
      requires(P & p, const PeerInfo& i) {
        { p.AddPeer(i) } -> std::same_as<Result<typename P::Peer*>>;
      },
      "needs Result<Peer*> AddPeer(const sdk::PeerInfo&)");
  static_assert(
      requires(P & p, typename P::Peer * peer, const PeerInfo& i) {
        { p.UpdatePeer(peer, i) } -> std::convertible_to<Status>;
      },
      "needs Status UpdatePeer(Peer*, const sdk::PeerInfo&)");
  static_assert(
      requires(P & p, typename P::Peer * peer) { p.RemovePeer(peer); },
      "needs void RemovePeer(Peer*)");
  static_assert(
      requires(P & p, typename P::Peer * peer, const Ops& ops, const PostOptions& o) {
        { p.Post(peer, ops, o) } -> std::same_as<Result<typename P::Request*>>;
      },
      "needs Result<Request*> Post(Peer*, const sdk::Ops&, const sdk::PostOptions&)");
  static_assert(
      requires(P & p, typename P::Request * r, std::span<kvb_status_t> st) {
        { p.Poll(r, st) } -> std::convertible_to<Status>;
      },
      "needs Status Poll(Request*, std::span<kvb_status_t>)");
  static_assert(
      requires(P & p, typename P::Request * r) { p.Cancel(r); }, "needs void Cancel(Request*)");
  static_assert(
      requires(P & p, typename P::Request * r) { p.Release(r); }, "needs void Release(Request*)");
  return true;
}

// The trampolines: one static function per slot, for one class P.
template <typename P>
struct TransportGlue {
  using Inst = Instance<P>;
  using PeerT = typename P::Peer;
  using RequestT = typename P::Request;

  static Inst& I(kvb_transport_t* t) { return *reinterpret_cast<Inst*>(t); }

  static kvb_status_t Create(const kvb_host_services_t* services,
                             const kvb_transport_params_t* params, kvb_transport_t** out, char* err,
                             uint32_t err_len) {
    return CreateInstance<P>(services, params != nullptr, out, err, err_len,
                             [&](Host host) { return P::Create(host, *params); });
  }

  static void Destroy(kvb_transport_t* t) { DestroyInstance<P>(t); }

  static int32_t GetEndpoints(kvb_transport_t* t, char* buf, uint32_t buf_len) {
    int32_t n = -2;
    Guard(I(t).host, "get_endpoints", nullptr, 0, [&] {
      const std::string ep = I(t).impl->Endpoints();
      if (buf != nullptr && ep.size() + 1 <= buf_len) {
        std::memcpy(buf, ep.c_str(), ep.size() + 1);
        n = static_cast<int32_t>(ep.size());
      }
      return KVB_OK;
    });
    return n;
  }

  static kvb_status_t RegisterMemory(kvb_transport_t* t, const kvb_region_t* region, uint8_t* rkey,
                                     uint32_t rkey_cap, uint32_t* rkey_len) {
    return Guard(I(t).host, "register_memory", nullptr, 0, [&]() -> kvb_status_t {
      if (region == nullptr) return KVB_ERR_INVALID_ARGUMENT;
      RkeyBuffer key(rkey, rkey_cap, rkey_len);
      return Logged(I(t).host, "register_memory",
                    I(t).impl->RegisterMemory(Region::From(region), key));
    });
  }

  static kvb_status_t DeregisterMemory(kvb_transport_t* t, uint64_t segment_id) {
    return Guard(I(t).host, "deregister_memory", nullptr, 0, [&] {
      return Logged(I(t).host, "deregister_memory", I(t).impl->DeregisterMemory(segment_id));
    });
  }

  static kvb_status_t AddPeer(kvb_transport_t* t, const kvb_peer_info_t* info, kvb_tpeer_t** out,
                              char* err, uint32_t err_len) {
    return Guard(I(t).host, "add_peer", err, err_len, [&]() -> kvb_status_t {
      if (info == nullptr || out == nullptr) {
        return NullArgument(P::kName, "add_peer", "info or out").ToAbi(err, err_len);
      }
      Result<PeerT*> peer = I(t).impl->AddPeer(PeerInfo::From(info));
      if (!peer.ok()) return peer.status().ToAbi(err, err_len);
      *out = reinterpret_cast<kvb_tpeer_t*>(*peer);
      kvb_copy_message(err, err_len, "");
      return KVB_OK;
    });
  }

  static kvb_status_t UpdatePeer(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_peer_info_t* info,
                                 char* err, uint32_t err_len) {
    return Guard(I(t).host, "update_peer", err, err_len, [&]() -> kvb_status_t {
      if (info == nullptr) {
        return NullArgument(P::kName, "update_peer", "info").ToAbi(err, err_len);
      }
      return Status(I(t).impl->UpdatePeer(reinterpret_cast<PeerT*>(peer), PeerInfo::From(info)))
          .ToAbi(err, err_len);
    });
  }

  static void RemovePeer(kvb_transport_t* t, kvb_tpeer_t* peer) {
    Guard(I(t).host, "remove_peer", nullptr, 0, [&] {
      I(t).impl->RemovePeer(reinterpret_cast<PeerT*>(peer));
      return KVB_OK;
    });
  }

  static kvb_status_t Post(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_xfer_op_t* ops,
                           uint32_t op_size, uint32_t count, const kvb_post_opts_t* opts,
                           kvb_treq_t** out, char* err, uint32_t err_len) {
    return Guard(I(t).host, "post", err, err_len, [&]() -> kvb_status_t {
      if (out == nullptr || (ops == nullptr && count != 0)) {
        return NullArgument(P::kName, "post", "ops or out").ToAbi(err, err_len);
      }
      Result<RequestT*> req = I(t).impl->Post(reinterpret_cast<PeerT*>(peer),
                                              Ops(ops, count, op_size), PostOptions::From(opts));
      if (!req.ok()) return req.status().ToAbi(err, err_len);
      *out = reinterpret_cast<kvb_treq_t*>(*req);
      kvb_copy_message(err, err_len, "");
      return KVB_OK;
    });
  }

  static kvb_status_t Poll(kvb_transport_t* t, kvb_treq_t* req, kvb_status_t* op_status,
                           uint32_t op_status_len, char* err, uint32_t err_len) {
    return Guard(I(t).host, "poll", err, err_len, [&] {
      std::span<kvb_status_t> st;
      if (op_status != nullptr) st = std::span<kvb_status_t>(op_status, op_status_len);
      return Status(I(t).impl->Poll(reinterpret_cast<RequestT*>(req), st)).ToAbi(err, err_len);
    });
  }

  static void Cancel(kvb_transport_t* t, kvb_treq_t* req) {
    Guard(I(t).host, "cancel", nullptr, 0, [&] {
      I(t).impl->Cancel(reinterpret_cast<RequestT*>(req));
      return KVB_OK;
    });
  }

  static void Release(kvb_transport_t* t, kvb_treq_t* req) {
    Guard(I(t).host, "release", nullptr, 0, [&] {
      I(t).impl->Release(reinterpret_cast<RequestT*>(req));
      return KVB_OK;
    });
  }

  static kvb_status_t GetStats(kvb_transport_t* t, kvb_transport_stats_t* stats) {
    return Guard(I(t).host, "get_stats", nullptr, 0, [&]() -> kvb_status_t {
      if (stats == nullptr || stats->struct_size < sizeof(uint32_t))
        return KVB_ERR_INVALID_ARGUMENT;
      kvb_transport_stats_t full{};
      full.struct_size = sizeof(full);
      const Status st = I(t).impl->Stats(full);
      if (!st.ok()) return Logged(I(t).host, "get_stats", st);
      return CopyVersioned(stats, full);
    });
  }

  // An exception leaves the descriptor's caps (logged by Guard).
  static uint64_t InstanceCaps(kvb_transport_t* t) {
    uint64_t caps = ~uint64_t{0};
    Guard(I(t).host, "instance_caps", nullptr, 0, [&] {
      caps = I(t).impl->InstanceCaps();
      return KVB_OK;
    });
    return caps;
  }

  static constexpr uint64_t Caps() {
    return P::kCaps | (HasTransportStats<P> ? KVB_TCAP_STATS : 0);
  }

  static constexpr kvb_transport_ops_t kOps = {
      .struct_size = sizeof(kvb_transport_ops_t),
      .create = Create,
      .destroy = Destroy,
      .get_endpoints = GetEndpoints,
      .register_memory = RegisterMemory,
      .deregister_memory = DeregisterMemory,
      .add_peer = AddPeer,
      .update_peer = UpdatePeer,
      .remove_peer = RemovePeer,
      .post = Post,
      .poll = Poll,
      .cancel = Cancel,
      .release = Release,
      .get_stats = KVB_SDK_SLOT(HasTransportStats<P>, GetStats, kvb_transport_stats_unsupported),
      .instance_caps =
          KVB_SDK_SLOT(HasInstanceCaps<P>, InstanceCaps, kvb_transport_instance_caps_all),
  };

  static constexpr kvb_plugin_descriptor_t kDescriptor =
      Descriptor<P>(KVB_PLUGIN_TRANSPORT, Caps(), &kOps);
};

}  // namespace detail

// The descriptor KVB_TRANSPORT_PLUGIN(P) exports, for a host of (major, minor): NULL for another
// major or a minor below P::kMinHostMinor. Callable directly (tests, a plugin exporting several
// classes behind its own kvb_plugin_query).
template <typename P>
const kvb_plugin_descriptor_t* TransportPluginQuery(uint16_t host_abi_major,
                                                    uint16_t host_abi_minor) noexcept {
  static_assert(detail::CheckTransportClass<P>());
  return detail::Query<P>(&detail::TransportGlue<P>::kDescriptor, host_abi_major, host_abi_minor);
}

}  // namespace kvbridge::plugin::sdk

// Exports kvb_plugin_query for transport class `Class`. Use once per plugin, at file scope.
#define KVB_TRANSPORT_PLUGIN(Class) KVB_SDK_EXPORT_QUERY(TransportPluginQuery, Class)
