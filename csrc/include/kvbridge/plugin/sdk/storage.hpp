// kvbridge plugin SDK for storage: a storage plugin written as a C++ class, and
// KVB_STORAGE_PLUGIN(Class), which turns it into the C ABI of storage.h (the descriptor, the ops
// table of trampolines, and the exported kvb_plugin_query).
//
// The class declares what it offers by the members it has; the capability flags follow, as the
// ABI ties them to the slots:
//
//   class MyStore {
//    public:
//     static constexpr const char* kName = "my";        // [a-z0-9_]{1,64}
//     static constexpr const char* kVersion = "1.0";
//     static constexpr bool kPersistent = true;         // optional: KVB_SCAP_PERSISTENT
//     static constexpr uint16_t kMinHostMinor = 0;      // optional: refuse older hosts
//     static sdk::Status Probe();                       // optional: OK when absent
//     static sdk::Result<std::unique_ptr<MyStore>> Create(sdk::Host, const sdk::StorageParams&);
//     sdk::Status Usage(kvb_storage_usage_t&);          // required
//     // POOL (KVB_SCAP_POOL), all three or none:
//     sdk::Result<sdk::Segment> Segment();
//     sdk::Result<uint64_t> Alloc(uint64_t length);     // the offset
//     sdk::Status Free(uint64_t offset);
//     // OBJECTS (KVB_SCAP_OBJECTS), all four or none:
//     sdk::Status Put(sdk::Bytes key, sdk::IoVecs iov, sdk::Bytes meta);  // or without meta
//     sdk::Status Get(sdk::Bytes key, sdk::IoVecs iov, uint64_t& length);
//     sdk::Status Remove(sdk::Bytes key);
//     sdk::Status ForEach(const sdk::ObjectVisitor& visit);
//   };
//   KVB_STORAGE_PLUGIN(MyStore)
//
// Put with a `meta` parameter makes put_meta and for_each_meta real (ABI 1.1; the trampoline
// refuses a blob over KVB_STORAGE_META_MAX before calling it, and plain put passes an empty
// one); without it they point to the ABI's UNSUPPORTED stubs, as do the slots of a shape the
// class does not offer. Every trampoline checks the ABI's pointers (a NULL key, out or visit is
// INVALID_ARGUMENT) and runs the member inside detail::Guard (an exception becomes
// KVB_ERR_INTERNAL, its text logged through the host).
//
// Thread-safety: the trampolines add no locking; storage.h's rules apply to the class's members:
// all may run concurrently except the destructor (destroy).
#pragma once

#include <memory>
#include <span>
#include <string>

#include "kvbridge/plugin/sdk/common.hpp"
#include "kvbridge/plugin/storage.h"

namespace kvbridge::plugin::sdk {

using IoVecs = std::span<const kvb_iovec_t>;

// A POOL plugin's segment: what the host registers with its transports.
struct Segment {
  void* addr = nullptr;
  uint64_t length = 0;
};

// create()'s params, fields beyond their struct_size at their defaults (on_evict NULL on a 1.0
// host: the plugin must then not evict on its own).
struct StorageParams {
  std::string_view node_id;
  uint64_t capacity_bytes = 0;
  const char* path = nullptr;  // NULL for memory-only plugins
  kvb_storage_evict_fn on_evict = nullptr;
  void* on_evict_user = nullptr;
  const kvb_storage_params_t* raw = nullptr;  // for a backend that takes the ABI struct

  // Tells the host one object disappeared on the plugin's own initiative (no-op without
  // on_evict). Call it after the object is gone, holding no lock the host could need.
  void Evicted(Bytes key) const {
    if (on_evict != nullptr) on_evict(on_evict_user, key.data(), static_cast<uint32_t>(key.size()));
  }

  static StorageParams From(const kvb_storage_params_t* p) {
    StorageParams out;
    out.raw = p;
    kvb_storage_params_t v{};
    const auto* b = reinterpret_cast<const uint8_t*>(p);
    const size_t avail = p->struct_size;
    KVB_SDK_READ_FIELD(v, b, avail, kvb_storage_params_t, node_id);
    KVB_SDK_READ_FIELD(v, b, avail, kvb_storage_params_t, capacity_bytes);
    KVB_SDK_READ_FIELD(v, b, avail, kvb_storage_params_t, path);
    KVB_SDK_READ_FIELD(v, b, avail, kvb_storage_params_t, on_evict);
    KVB_SDK_READ_FIELD(v, b, avail, kvb_storage_params_t, on_evict_user);
    if (v.node_id != nullptr) out.node_id = v.node_id;
    out.capacity_bytes = v.capacity_bytes;
    out.path = v.path;
    out.on_evict = v.on_evict;
    out.on_evict_user = v.on_evict_user;
    return out;
  }
};

// What for_each / for_each_meta hand a plugin's ForEach: call it once per stored object. The
// raw callbacks are there for a backend that takes them (one of the two is NULL).
class ObjectVisitor {
 public:
  ObjectVisitor(kvb_storage_visit_fn visit, kvb_storage_visit_meta_fn visit_meta, void* user)
      : visit_(visit), visit_meta_(visit_meta), user_(user) {}

  void operator()(Bytes key, uint64_t length, Bytes meta = {}) const {
    const auto klen = static_cast<uint32_t>(key.size());
    if (visit_meta_ != nullptr) {
      visit_meta_(user_, key.data(), klen, length, meta.data(), static_cast<uint32_t>(meta.size()));
    } else {
      visit_(user_, key.data(), klen, length);
    }
  }

  kvb_storage_visit_fn visit_fn() const { return visit_; }
  kvb_storage_visit_meta_fn visit_meta_fn() const { return visit_meta_; }
  void* user() const { return user_; }

 private:
  kvb_storage_visit_fn visit_;
  kvb_storage_visit_meta_fn visit_meta_;
  void* user_;
};

namespace detail {

template <typename P>
concept HasPoolSegment = requires(P& p) {
  { p.Segment() } -> std::convertible_to<Result<Segment>>;
};
template <typename P>
concept HasPoolAlloc = requires(P& p) {
  { p.Alloc(uint64_t{}) } -> std::same_as<Result<uint64_t>>;
};
template <typename P>
concept HasPoolFree = requires(P& p) {
  { p.Free(uint64_t{}) } -> std::convertible_to<Status>;
};
template <typename P>
concept HasPutMeta = requires(P& p, Bytes b, IoVecs iov) {
  { p.Put(b, iov, b) } -> std::convertible_to<Status>;
};
template <typename P>
concept HasPut = HasPutMeta<P> || requires(P& p, Bytes b, IoVecs iov) {
  { p.Put(b, iov) } -> std::convertible_to<Status>;
};
template <typename P>
concept HasGet = requires(P& p, Bytes b, IoVecs iov, uint64_t& n) {
  { p.Get(b, iov, n) } -> std::convertible_to<Status>;
};
template <typename P>
concept HasRemove = requires(P& p, Bytes b) {
  { p.Remove(b) } -> std::convertible_to<Status>;
};
template <typename P>
concept HasForEach = requires(P& p, const ObjectVisitor& v) {
  { p.ForEach(v) } -> std::convertible_to<Status>;
};

template <typename P>
constexpr bool kPool = HasPoolSegment<P>&& HasPoolAlloc<P>&& HasPoolFree<P>;
template <typename P>
constexpr bool kObjects = HasPut<P>&& HasGet<P>&& HasRemove<P>&& HasForEach<P>;

template <typename P>
constexpr bool Persistent() {
  if constexpr (requires { P::kPersistent; }) {
    return P::kPersistent;
  } else {
    return false;
  }
}

template <typename P>
constexpr bool CheckStorageClass() {
  CheckIdentity<P>();
  static_assert(
      requires(Host h, const StorageParams& params) {
        { P::Create(h, params) } -> std::same_as<Result<std::unique_ptr<P>>>;
      },
      "needs static Result<std::unique_ptr<Self>> Create(sdk::Host, const sdk::StorageParams&)");
  static_assert(
      requires(P & p, kvb_storage_usage_t & u) {
        { p.Usage(u) } -> std::convertible_to<Status>;
      },
      "needs Status Usage(kvb_storage_usage_t&)");
  static_assert(HasPoolSegment<P> == HasPoolAlloc<P> && HasPoolAlloc<P> == HasPoolFree<P>,
                "POOL needs all of Result<sdk::Segment> Segment(), Result<uint64_t> "
                "Alloc(uint64_t) and Status Free(uint64_t), or none of them");
  static_assert(
      HasPut<P> == HasGet<P> && HasGet<P> == HasRemove<P> && HasRemove<P> == HasForEach<P>,
      "OBJECTS needs all of Put(Bytes, IoVecs[, Bytes meta]), Get(Bytes, IoVecs, "
      "uint64_t&), Remove(Bytes) and ForEach(const sdk::ObjectVisitor&), or none of them");
  static_assert(
      kPool<P> || kObjects<P>,
      "a storage class offers POOL (Segment/Alloc/Free) or OBJECTS (Put/Get/Remove/ForEach)");
  return true;
}

template <typename P>
struct StorageGlue {
  using Inst = Instance<P>;
  static Inst& I(kvb_storage_t* s) { return *reinterpret_cast<Inst*>(s); }

  static Status NullArgument(const char* op, const char* what) {
    return detail::NullArgument(P::kName, op, what);
  }

  // Runs an op without an err buffer: Guard, and a failure's message to the log.
  template <typename Fn>
  static kvb_status_t Run(kvb_storage_t* s, const char* op, Fn&& fn) {
    return Guard(I(s).host, op, nullptr, 0, [&] { return Logged(I(s).host, op, fn()); });
  }

  static kvb_status_t Create(const kvb_host_services_t* services,
                             const kvb_storage_params_t* params, kvb_storage_t** out, char* err,
                             uint32_t err_len) {
    return CreateInstance<P>(services, params != nullptr, out, err, err_len, [&](Host host) {
      return P::Create(host, StorageParams::From(params));
    });
  }

  static void Destroy(kvb_storage_t* s) { DestroyInstance<P>(s); }

  static kvb_status_t Usage(kvb_storage_t* s, kvb_storage_usage_t* out) {
    return Run(s, "usage", [&]() -> Status {
      if (out == nullptr || out->struct_size < sizeof(uint32_t))
        return NullArgument("usage", "out");
      kvb_storage_usage_t full{};
      full.struct_size = sizeof(full);
      Status st = I(s).impl->Usage(full);
      if (!st.ok()) return st;
      return CopyVersioned(out, full);
    });
  }

  static kvb_status_t GetSegment(kvb_storage_t* s, void** addr, uint64_t* length) {
    return Run(s, "get_segment", [&]() -> Status {
      if (addr == nullptr || length == nullptr)
        return NullArgument("get_segment", "addr or length");
      Result<sdk::Segment> seg = I(s).impl->Segment();
      if (!seg.ok()) return seg.status();
      *addr = seg->addr;
      *length = seg->length;
      return Status();
    });
  }

  static kvb_status_t Alloc(kvb_storage_t* s, uint64_t length, uint64_t* offset) {
    return Run(s, "alloc", [&]() -> Status {
      if (offset == nullptr) return NullArgument("alloc", "offset");
      Result<uint64_t> off = I(s).impl->Alloc(length);
      if (!off.ok()) return off.status();
      *offset = *off;
      return Status();
    });
  }

  static kvb_status_t Free(kvb_storage_t* s, uint64_t offset) {
    return Run(s, "free", [&] { return Status(I(s).impl->Free(offset)); });
  }

  static Status CheckObjectArgs(const char* op, const uint8_t* key, const kvb_iovec_t* iov,
                                uint32_t iov_count) {
    if (key == nullptr) return NullArgument(op, "key");
    if (iov == nullptr && iov_count != 0) return NullArgument(op, "iov");
    return Status();
  }

  static kvb_status_t PutMeta(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                              const kvb_iovec_t* iov, uint32_t iov_count, const uint8_t* meta,
                              uint32_t meta_len) {
    return Run(s, "put_meta", [&]() -> Status {
      Status st = CheckObjectArgs("put_meta", key, iov, iov_count);
      if (!st.ok()) return st;
      if (meta == nullptr && meta_len != 0) return NullArgument("put_meta", "meta");
      if (meta_len > KVB_STORAGE_META_MAX) {
        return Status(KVB_ERR_INVALID_ARGUMENT, std::string(P::kName) + ": put_meta: metadata of " +
                                                    std::to_string(meta_len) +
                                                    " bytes is over KVB_STORAGE_META_MAX (" +
                                                    std::to_string(KVB_STORAGE_META_MAX) + ")");
      }
      return I(s).impl->Put(Bytes(key, key_len), IoVecs(iov, iov_count), Bytes(meta, meta_len));
    });
  }

  static kvb_status_t Put(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                          const kvb_iovec_t* iov, uint32_t iov_count) {
    return Run(s, "put", [&]() -> Status {
      Status st = CheckObjectArgs("put", key, iov, iov_count);
      if (!st.ok()) return st;
      if constexpr (HasPutMeta<P>) {
        return I(s).impl->Put(Bytes(key, key_len), IoVecs(iov, iov_count), Bytes());
      } else {
        return I(s).impl->Put(Bytes(key, key_len), IoVecs(iov, iov_count));
      }
    });
  }

  static kvb_status_t Get(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                          const kvb_iovec_t* iov, uint32_t iov_count, uint64_t* length) {
    return Run(s, "get", [&]() -> Status {
      Status st = CheckObjectArgs("get", key, iov, iov_count);
      if (!st.ok()) return st;
      uint64_t n = 0;
      st = I(s).impl->Get(Bytes(key, key_len), IoVecs(iov, iov_count), n);
      if (length != nullptr) *length = n;
      return st;
    });
  }

  static kvb_status_t Remove(kvb_storage_t* s, const uint8_t* key, uint32_t key_len) {
    return Run(s, "remove", [&]() -> Status {
      if (key == nullptr) return NullArgument("remove", "key");
      return I(s).impl->Remove(Bytes(key, key_len));
    });
  }

  static kvb_status_t ForEach(kvb_storage_t* s, kvb_storage_visit_fn visit, void* user) {
    return Run(s, "for_each", [&]() -> Status {
      if (visit == nullptr) return NullArgument("for_each", "visit");
      return I(s).impl->ForEach(ObjectVisitor(visit, nullptr, user));
    });
  }

  static kvb_status_t ForEachMeta(kvb_storage_t* s, kvb_storage_visit_meta_fn visit, void* user) {
    return Run(s, "for_each_meta", [&]() -> Status {
      if (visit == nullptr) return NullArgument("for_each_meta", "visit");
      return I(s).impl->ForEach(ObjectVisitor(nullptr, visit, user));
    });
  }

  static constexpr uint64_t Caps() {
    return (kPool<P> ? KVB_SCAP_POOL : 0) | (kObjects<P> ? KVB_SCAP_OBJECTS : 0) |
           (Persistent<P>() ? KVB_SCAP_PERSISTENT : 0);
  }

  static constexpr bool kMeta = kObjects<P> && HasPutMeta<P>;

  static constexpr kvb_storage_ops_t kOps = {
      .struct_size = sizeof(kvb_storage_ops_t),
      .create = Create,
      .destroy = Destroy,
      .usage = Usage,
      .get_segment = KVB_SDK_SLOT(kPool<P>, GetSegment, kvb_storage_get_segment_unsupported),
      .alloc = KVB_SDK_SLOT(kPool<P>, Alloc, kvb_storage_alloc_unsupported),
      .free = KVB_SDK_SLOT(kPool<P>, Free, kvb_storage_free_unsupported),
      .put = KVB_SDK_SLOT(kObjects<P>, Put, kvb_storage_put_unsupported),
      .get = KVB_SDK_SLOT(kObjects<P>, Get, kvb_storage_get_unsupported),
      .remove = KVB_SDK_SLOT(kObjects<P>, Remove, kvb_storage_remove_unsupported),
      .for_each = KVB_SDK_SLOT(kObjects<P>, ForEach, kvb_storage_for_each_unsupported),
      .put_meta = KVB_SDK_SLOT(kMeta, PutMeta, kvb_storage_put_meta_unsupported),
      .for_each_meta = KVB_SDK_SLOT(kMeta, ForEachMeta, kvb_storage_for_each_meta_unsupported),
  };

  static constexpr kvb_plugin_descriptor_t kDescriptor =
      Descriptor<P>(KVB_PLUGIN_STORAGE, Caps(), &kOps);
};

}  // namespace detail

// The descriptor KVB_STORAGE_PLUGIN(P) exports, for a host of (major, minor): NULL for another
// major or a minor below P::kMinHostMinor.
template <typename P>
const kvb_plugin_descriptor_t* StoragePluginQuery(uint16_t host_abi_major,
                                                  uint16_t host_abi_minor) noexcept {
  static_assert(detail::CheckStorageClass<P>());
  return detail::Query<P>(&detail::StorageGlue<P>::kDescriptor, host_abi_major, host_abi_minor);
}

}  // namespace kvbridge::plugin::sdk

// Exports kvb_plugin_query for storage class `Class`. Use once per plugin, at file scope.
#define KVB_STORAGE_PLUGIN(Class) KVB_SDK_EXPORT_QUERY(StoragePluginQuery, Class)
