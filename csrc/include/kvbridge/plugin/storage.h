/*
 * kvbridge storage plugin ABI: where a storage node keeps KV objects.
 *
 * Two shapes, chosen by capability flags (a plugin may offer both):
 *  - POOL (KVB_SCAP_POOL): an allocator over one memory segment that the host registers with
 *    its transports, so clients read and write object bytes one-sided (the DRAM pool).
 *  - OBJECTS (KVB_SCAP_OBJECTS): keyed put/get/remove through the node (the SSD tier).
 *
 * Contract:
 *  - Capacity is params.capacity_bytes, possibly rounded up to the plugin's granularity (the
 *    DRAM pool rounds to 2 MiB); usage() reports the real figure. A request beyond it fails
 *    with KVB_ERR_NO_SPACE and changes nothing.
 *  - A failed put leaves no partial object visible to get; a get never returns bytes that fail
 *    the object's checksum (KVB_ERR_IO instead).
 *
 * Thread-safety: all ops may be called concurrently, except destroy().
 *
 * Pure C99.
 */
#ifndef KVBRIDGE_PLUGIN_STORAGE_H_
#define KVBRIDGE_PLUGIN_STORAGE_H_

#include "kvbridge/plugin/abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVB_SCAP_POOL ((uint64_t)1 << 0)       /* get_segment / alloc / free */
#define KVB_SCAP_OBJECTS ((uint64_t)1 << 1)    /* put / get / remove / for_each */
#define KVB_SCAP_PERSISTENT ((uint64_t)1 << 2) /* objects survive a process restart */
#define KVB_SCAP_KNOWN_MASK ((uint64_t)0x7)

typedef struct kvb_storage kvb_storage_t;

/* Called by a plugin that evicts objects on its own (the SSD tier drops whole buckets, oldest
 * first, to make room): once per object that disappeared, after it is gone. May be called from
 * any thread, inside put/put_meta; must not call back into the plugin. */
typedef void (*kvb_storage_evict_fn)(void* user, const uint8_t* key, uint32_t key_len);

typedef struct kvb_storage_params {
  uint32_t struct_size;
  const char* node_id;
  uint64_t capacity_bytes;
  const char* path; /* directory for file-backed plugins; NULL for memory-only ones */
  /* --- ABI 1.1 (a plugin must check struct_size before reading these) --- */
  /* NULL: the plugin must not evict on its own; a put beyond capacity is NO_SPACE. */
  kvb_storage_evict_fn on_evict;
  void* on_evict_user;
} kvb_storage_params_t;

/* Longest metadata blob put_meta stores with an object. */
#define KVB_STORAGE_META_MAX 256

typedef struct kvb_storage_usage {
  uint32_t struct_size;
  uint64_t capacity_bytes;
  uint64_t used_bytes;
  uint64_t object_count; /* live pool allocations plus stored objects */
} kvb_storage_usage_t;

typedef struct kvb_iovec {
  void* base;
  uint64_t length;
} kvb_iovec_t;

typedef void (*kvb_storage_visit_fn)(void* user, const uint8_t* key, uint32_t key_len,
                                     uint64_t length);
typedef void (*kvb_storage_visit_meta_fn)(void* user, const uint8_t* key, uint32_t key_len,
                                          uint64_t length, const uint8_t* meta, uint32_t meta_len);

typedef struct kvb_storage_ops {
  uint32_t struct_size;

  kvb_status_t (*create)(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                         kvb_storage_t** out, char* err, uint32_t err_len);
  void (*destroy)(kvb_storage_t* s);
  kvb_status_t (*usage)(kvb_storage_t* s, kvb_storage_usage_t* out);

  /* POOL: the whole segment the host registers with its transports. */
  kvb_status_t (*get_segment)(kvb_storage_t* s, void** addr, uint64_t* length);
  /* POOL: reserves `length` bytes; *offset is relative to the segment start. length 0 is
   * INVALID_ARGUMENT; no room is NO_SPACE. */
  kvb_status_t (*alloc)(kvb_storage_t* s, uint64_t length, uint64_t* offset);
  /* POOL: frees the allocation starting at offset; NOT_FOUND (nothing changes) if none does. */
  kvb_status_t (*free)(kvb_storage_t* s, uint64_t offset);

  /* OBJECTS: stores the concatenation of iov under key; replaces nothing (ALREADY_EXISTS). */
  kvb_status_t (*put)(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                      const kvb_iovec_t* iov, uint32_t iov_count);
  /* OBJECTS: reads the object into iov; *length receives the object size, also when iov is too
   * small (INVALID_ARGUMENT, nothing copied), so the caller can retry with enough room.
   * NOT_FOUND if absent. */
  kvb_status_t (*get)(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                      const kvb_iovec_t* iov, uint32_t iov_count, uint64_t* length);
  kvb_status_t (*remove)(kvb_storage_t* s, const uint8_t* key, uint32_t key_len);
  /* OBJECTS: calls visit once per stored object (inventory after a restart). */
  kvb_status_t (*for_each)(kvb_storage_t* s, kvb_storage_visit_fn visit, void* user);

  /* --- ABI 1.1: the host uses these only when struct_size covers them --- */
  /* OBJECTS: put with an opaque metadata blob (meta_len <= KVB_STORAGE_META_MAX, else
   * INVALID_ARGUMENT) kept with the object (the store keeps version and checksum there). */
  kvb_status_t (*put_meta)(kvb_storage_t* s, const uint8_t* key, uint32_t key_len,
                           const kvb_iovec_t* iov, uint32_t iov_count, const uint8_t* meta,
                           uint32_t meta_len);
  /* OBJECTS: for_each that also hands each object's metadata (meta_len 0 after plain put). */
  kvb_status_t (*for_each_meta)(kvb_storage_t* s, kvb_storage_visit_meta_fn visit, void* user);
} kvb_storage_ops_t;

/* Stubs for the slots of a shape a plugin does not offer (never leave a slot NULL). */
static inline kvb_status_t kvb_storage_get_segment_unsupported(kvb_storage_t* s, void** addr,
                                                               uint64_t* length) {
  (void)s, (void)addr, (void)length;
  return KVB_ERR_UNSUPPORTED;
}
static inline kvb_status_t kvb_storage_alloc_unsupported(kvb_storage_t* s, uint64_t length,
                                                         uint64_t* offset) {
  (void)s, (void)length, (void)offset;
  return KVB_ERR_UNSUPPORTED;
}
static inline kvb_status_t kvb_storage_free_unsupported(kvb_storage_t* s, uint64_t offset) {
  (void)s, (void)offset;
  return KVB_ERR_UNSUPPORTED;
}
static inline kvb_status_t kvb_storage_put_unsupported(kvb_storage_t* s, const uint8_t* key,
                                                       uint32_t key_len, const kvb_iovec_t* iov,
                                                       uint32_t iov_count) {
  (void)s, (void)key, (void)key_len, (void)iov, (void)iov_count;
  return KVB_ERR_UNSUPPORTED;
}
static inline kvb_status_t kvb_storage_get_unsupported(kvb_storage_t* s, const uint8_t* key,
                                                       uint32_t key_len, const kvb_iovec_t* iov,
                                                       uint32_t iov_count, uint64_t* length) {
  (void)s, (void)key, (void)key_len, (void)iov, (void)iov_count, (void)length;
  return KVB_ERR_UNSUPPORTED;
}
static inline kvb_status_t kvb_storage_remove_unsupported(kvb_storage_t* s, const uint8_t* key,
                                                          uint32_t key_len) {
  (void)s, (void)key, (void)key_len;
  return KVB_ERR_UNSUPPORTED;
}
static inline kvb_status_t kvb_storage_for_each_unsupported(kvb_storage_t* s,
                                                            kvb_storage_visit_fn visit,
                                                            void* user) {
  (void)s, (void)visit, (void)user;
  return KVB_ERR_UNSUPPORTED;
}

static inline kvb_status_t kvb_storage_put_meta_unsupported(kvb_storage_t* s, const uint8_t* key,
                                                            uint32_t key_len,
                                                            const kvb_iovec_t* iov,
                                                            uint32_t iov_count, const uint8_t* meta,
                                                            uint32_t meta_len) {
  (void)s, (void)key, (void)key_len, (void)iov, (void)iov_count, (void)meta, (void)meta_len;
  return KVB_ERR_UNSUPPORTED;
}
static inline kvb_status_t kvb_storage_for_each_meta_unsupported(kvb_storage_t* s,
                                                                 kvb_storage_visit_meta_fn visit,
                                                                 void* user) {
  (void)s, (void)visit, (void)user;
  return KVB_ERR_UNSUPPORTED;
}

#ifdef __cplusplus
}
#endif

#endif /* KVBRIDGE_PLUGIN_STORAGE_H_ */
