// libkvb_storage_mock.so — storage plugin "mock": a small, correct storage plugin that proves
// storage loading and gives store tests something to run on.
//
// POOL: one malloc'd segment of capacity_bytes with a first-fit allocator over a free list
// (64-byte aligned blocks, neighbours merged on free). OBJECTS: a std::map of byte vectors, each
// with the metadata blob of put_meta (ABI 1.1; empty after a plain put). Pool allocations and
// objects share the capacity: used = allocated blocks + object bytes (metadata is not counted).
// It never evicts on its own, so it ignores params.on_evict. Not persistent. All ops take one
// mutex; fine for tests.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kvbridge/plugin/storage.h"

namespace {

constexpr uint64_t kAlign = 64;

uint64_t AlignUp(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

struct MockObject {
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> meta;
};

struct kvb_storage {
  std::mutex mu;
  uint8_t* segment = nullptr;
  uint64_t capacity = 0;
  uint64_t used = 0;
  std::map<uint64_t, uint64_t> free_blocks;  // offset -> length
  std::map<uint64_t, uint64_t> allocated;    // offset -> length
  std::map<std::string, MockObject> objects;
};

namespace {

kvb_status_t StorageCreate(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                           kvb_storage_t** out, char* err, uint32_t err_len) {
  if (params == nullptr || out == nullptr || params->capacity_bytes == 0) {
    kvb_copy_message(err, err_len, "mock storage: capacity_bytes must be > 0");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  try {
    auto* s = new kvb_storage;
    s->capacity = params->capacity_bytes;
    s->segment = static_cast<uint8_t*>(std::malloc(s->capacity));
    if (s->segment == nullptr) {
      delete s;
      kvb_copy_message(err, err_len, "mock storage: cannot allocate the pool segment");
      return KVB_ERR_NO_SPACE;
    }
    s->free_blocks[0] = s->capacity;
    *out = s;
    return KVB_OK;
  } catch (...) {
    kvb_copy_message(err, err_len, "mock storage: out of memory");
    return KVB_ERR_INTERNAL;
  }
}

void StorageDestroy(kvb_storage_t* s) {
  if (s == nullptr) return;
  std::free(s->segment);
  delete s;
}

kvb_status_t StorageUsage(kvb_storage_t* s, kvb_storage_usage_t* out) {
  if (out == nullptr || out->struct_size < sizeof(kvb_storage_usage_t)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lk(s->mu);
  out->capacity_bytes = s->capacity;
  out->used_bytes = s->used;
  out->object_count = s->objects.size();
  return KVB_OK;
}

kvb_status_t StorageGetSegment(kvb_storage_t* s, void** addr, uint64_t* length) {
  if (addr == nullptr || length == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  *addr = s->segment;
  *length = s->capacity;
  return KVB_OK;
}

kvb_status_t StorageAlloc(kvb_storage_t* s, uint64_t length, uint64_t* offset) {
  if (length == 0 || offset == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  const uint64_t need = AlignUp(length);
  std::lock_guard<std::mutex> lk(s->mu);
  if (need > s->capacity - s->used) return KVB_ERR_NO_SPACE;
  for (auto it = s->free_blocks.begin(); it != s->free_blocks.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t at = it->first;
    const uint64_t rest = it->second - need;
    s->free_blocks.erase(it);
    if (rest != 0) s->free_blocks[at + need] = rest;
    s->allocated[at] = need;
    s->used += need;
    *offset = at;
    return KVB_OK;
  }
  return KVB_ERR_NO_SPACE;  // enough bytes in total, but fragmented
}

kvb_status_t StorageFree(kvb_storage_t* s, uint64_t offset) {
  std::lock_guard<std::mutex> lk(s->mu);
  auto a = s->allocated.find(offset);
  if (a == s->allocated.end()) return KVB_ERR_NOT_FOUND;
  uint64_t at = a->first, len = a->second;
  s->allocated.erase(a);
  s->used -= len;
  auto next = s->free_blocks.lower_bound(at);
  if (next != s->free_blocks.end() && at + len == next->first) {
    len += next->second;
    next = s->free_blocks.erase(next);
  }
  if (next != s->free_blocks.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      prev->second += len;
      return KVB_OK;
    }
  }
  s->free_blocks[at] = len;
  return KVB_OK;
}

kvb_status_t StoragePutMeta(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                            const kvb_iovec_t* iov, uint32_t iov_count, const uint8_t* meta,
                            uint32_t meta_len) {
  if (key == nullptr || key_len == 0 || (iov == nullptr && iov_count != 0) ||
      meta_len > KVB_STORAGE_META_MAX || (meta == nullptr && meta_len != 0)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  try {
    std::string k(reinterpret_cast<const char*>(key), key_len);
    uint64_t total = 0;
    for (uint32_t i = 0; i < iov_count; ++i) total += iov[i].length;
    std::lock_guard<std::mutex> lk(s->mu);
    if (s->objects.count(k) != 0) return KVB_ERR_ALREADY_EXISTS;
    if (total > s->capacity - s->used) return KVB_ERR_NO_SPACE;
    MockObject obj;
    obj.bytes.reserve(total);
    for (uint32_t i = 0; i < iov_count; ++i) {
      const auto* p = static_cast<const uint8_t*>(iov[i].base);
      obj.bytes.insert(obj.bytes.end(), p, p + iov[i].length);
    }
    if (meta_len != 0) obj.meta.assign(meta, meta + meta_len);
    s->objects.emplace(std::move(k), std::move(obj));
    s->used += total;
    return KVB_OK;
  } catch (...) {
    return KVB_ERR_INTERNAL;
  }
}

kvb_status_t StoragePut(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                        const kvb_iovec_t* iov, uint32_t iov_count) {
  return StoragePutMeta(s, key, key_len, iov, iov_count, nullptr, 0);
}

kvb_status_t StorageGet(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                        const kvb_iovec_t* iov, uint32_t iov_count, uint64_t* length) {
  if (key == nullptr || key_len == 0 || (iov == nullptr && iov_count != 0)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  try {
    std::string k(reinterpret_cast<const char*>(key), key_len);
    std::lock_guard<std::mutex> lk(s->mu);
    auto it = s->objects.find(k);
    if (it == s->objects.end()) return KVB_ERR_NOT_FOUND;
    const std::vector<uint8_t>& bytes = it->second.bytes;
    if (length != nullptr) *length = bytes.size();
    uint64_t room = 0;
    for (uint32_t i = 0; i < iov_count; ++i) room += iov[i].length;
    if (room < bytes.size()) return KVB_ERR_INVALID_ARGUMENT;
    uint64_t done = 0;
    for (uint32_t i = 0; i < iov_count && done < bytes.size(); ++i) {
      uint64_t n = std::min<uint64_t>(iov[i].length, bytes.size() - done);
      std::memcpy(iov[i].base, bytes.data() + done, n);
      done += n;
    }
    return KVB_OK;
  } catch (...) {
    return KVB_ERR_INTERNAL;
  }
}

kvb_status_t StorageRemove(kvb_storage_t* s, const uint8_t* key, uint32_t key_len) {
  if (key == nullptr || key_len == 0) return KVB_ERR_INVALID_ARGUMENT;
  try {
    std::lock_guard<std::mutex> lk(s->mu);
    auto it = s->objects.find(std::string(reinterpret_cast<const char*>(key), key_len));
    if (it == s->objects.end()) return KVB_ERR_NOT_FOUND;
    s->used -= it->second.bytes.size();
    s->objects.erase(it);
    return KVB_OK;
  } catch (...) {
    return KVB_ERR_INTERNAL;
  }
}

kvb_status_t StorageForEach(kvb_storage_t* s, kvb_storage_visit_fn visit, void* user) {
  if (visit == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  std::lock_guard<std::mutex> lk(s->mu);
  for (const auto& [key, obj] : s->objects) {
    visit(user, reinterpret_cast<const uint8_t*>(key.data()), static_cast<uint32_t>(key.size()),
          obj.bytes.size());
  }
  return KVB_OK;
}

kvb_status_t StorageForEachMeta(kvb_storage_t* s, kvb_storage_visit_meta_fn visit, void* user) {
  if (visit == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  std::lock_guard<std::mutex> lk(s->mu);
  for (const auto& [key, obj] : s->objects) {
    visit(user, reinterpret_cast<const uint8_t*>(key.data()), static_cast<uint32_t>(key.size()),
          obj.bytes.size(), obj.meta.data(), static_cast<uint32_t>(obj.meta.size()));
  }
  return KVB_OK;
}

kvb_status_t StorageProbe(char* reason, uint32_t reason_len) {
  kvb_copy_message(reason, reason_len, "");
  return KVB_OK;
}

const kvb_storage_ops_t kOps = {
    .struct_size = sizeof(kvb_storage_ops_t),
    .create = StorageCreate,
    .destroy = StorageDestroy,
    .usage = StorageUsage,
    .get_segment = StorageGetSegment,
    .alloc = StorageAlloc,
    .free = StorageFree,
    .put = StoragePut,
    .get = StorageGet,
    .remove = StorageRemove,
    .for_each = StorageForEach,
    .put_meta = StoragePutMeta,
    .for_each_meta = StorageForEachMeta,
};

const kvb_plugin_descriptor_t kDescriptor = {
    .struct_size = sizeof(kvb_plugin_descriptor_t),
    .abi_major = KVB_ABI_MAJOR,
    .abi_minor = KVB_ABI_MINOR,
    .name = "mock",
    .version = "0.1.0",
    .kind = KVB_PLUGIN_STORAGE,
    .reserved = 0,
    .caps = KVB_SCAP_POOL | KVB_SCAP_OBJECTS,
    .probe = StorageProbe,
    .ops = &kOps,
};

}  // namespace

extern "C" KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(
    uint16_t host_abi_major, uint16_t host_abi_minor) {
  return host_abi_major == KVB_ABI_MAJOR ? &kDescriptor : nullptr;
}
