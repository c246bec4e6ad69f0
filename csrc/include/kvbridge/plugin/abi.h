/*
 * kvbridge plugin ABI: the part shared by every plugin kind.
 *
 * A plugin is a shared library that exports exactly one symbol, kvb_plugin_query(). The host
 * calls it with the ABI version it speaks; the plugin returns a static descriptor naming
 * itself, its kind, its capability flags and its ops table (see transport.h / storage.h).
 *
 * Versioning rules (PJRT-style):
 *  - Every struct starts with `uint32_t struct_size`. A reader never touches a field that lies
 *    beyond the struct_size it was handed; such fields read as "absent / unsupported".
 *  - A minor bump only appends fields to the end of structs and appends new status codes and
 *    capability bits. A major bump is incompatible: the host refuses a plugin whose major differs
 *    and names the file and both versions in the message.
 *  - Ops tables are filled with designated initializers. Optional ops point to a stub returning
 *    KVB_ERR_UNSUPPORTED, never NULL; the loader refuses a table with a NULL slot.
 *  - Status codes are int32 and map 1:1 onto kvbridge::StatusCode (status.h).
 *  - Memory: a plugin frees what it created; the host frees what it created. Strings handed
 *    across the ABI are borrowed for the duration of the call unless a comment says otherwise.
 *  - No C++ exception ever crosses the ABI; a plugin written in C++ catches at its boundary.
 *
 * Thread-safety: kvb_plugin_query() may be called from any thread, any number of times, and
 * must return the same descriptor each time. The host-services functions are thread-safe.
 *
 * This header is pure C99 and depends on nothing but <stdint.h> and <stddef.h>.
 */
#ifndef KVBRIDGE_PLUGIN_ABI_H_
#define KVBRIDGE_PLUGIN_ABI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVB_ABI_MAJOR 1
/* 1.1: storage put_meta / for_each_meta, params.on_evict.
 * 1.2: host services for identity and the cluster-token handshake (node_id ... auth_end),
 *      device-memory services (dev_stream_create ... pinned_free), KVB_ERR_UNKNOWN_MEMORY.
 * 1.3: transport instance_caps (an instance narrows its descriptor's caps), KVB_TCAP_CUDA_DIRECT.
 * 1.4: kvb_xfer_op_t.flags (was reserved) and .crc, KVB_TCAP_OP_CRC32C: a transport takes the
 *      checksum of an op's bytes as they move.
 * 1.5: kvb_region_t.reg_flags and KVB_REG_LOCAL_ONLY: a transport can register a region that
 *      only this process's ops use (its key is not published); kvb_transport_stats_t says how
 *      device memory moves (device_regions_direct/_staged, device_bytes_staged).
 */
#define KVB_ABI_MINOR 5

/* Name of the one symbol every plugin exports. */
#define KVB_PLUGIN_QUERY_SYMBOL "kvb_plugin_query"

#if defined(__GNUC__)
#define KVB_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define KVB_PLUGIN_EXPORT
#endif

/* Status codes. 0 is success, 1 means "not finished yet"; everything else is an error whose
 * name says what happened so the caller can act. Values never change once published. */
typedef int32_t kvb_status_t;
enum {
  KVB_OK = 0,
  KVB_IN_PROGRESS = 1,
  KVB_ERR_INVALID_ARGUMENT = 2, /* caller passed something malformed */
  KVB_ERR_NOT_FOUND = 3,        /* unknown key, peer, segment or batch */
  KVB_ERR_ALREADY_EXISTS = 4,
  KVB_ERR_NOT_REGISTERED = 5,    /* memory (local or remote) is not inside a registered region */
  KVB_ERR_OUT_OF_BOUNDS = 6,     /* offset/length outside the remote registered region */
  KVB_ERR_STALE_PEER = 7,        /* peer identity (node id, incarnation) does not match */
  KVB_ERR_PEER_UNREACHABLE = 8,  /* cannot connect, connection lost, or circuit open */
  KVB_ERR_DEADLINE_EXCEEDED = 9, /* the operation's deadline passed */
  KVB_ERR_PROGRESS_TIMEOUT = 10, /* the peer stopped moving bytes for longer than allowed */
  KVB_ERR_BACKPRESSURE = 11,     /* a queue bound was reached; retry later */
  KVB_ERR_CANCELLED = 12,
  KVB_ERR_PROTOCOL = 13,        /* malformed frame or protocol violation */
  KVB_ERR_UNAUTHENTICATED = 14, /* cluster token missing or wrong */
  KVB_ERR_UNSUPPORTED = 15,     /* the plugin does not implement this op / capability */
  KVB_ERR_UNAVAILABLE = 16,     /* the plugin cannot run here (missing library, no device) */
  KVB_ERR_NO_SPACE = 17,
  KVB_ERR_IO = 18,
  KVB_ERR_INTERNAL = 19,
  KVB_ERR_PERMISSION_DENIED = 20, /* authenticated, but not allowed this call (admin token) */
  KVB_ERR_UNKNOWN_MEMORY = 21 /* neither mapped host memory nor device memory of the kind named */
};
#define KVB_STATUS_CODE_COUNT 22

typedef enum kvb_plugin_kind { KVB_PLUGIN_TRANSPORT = 1, KVB_PLUGIN_STORAGE = 2 } kvb_plugin_kind_t;

typedef enum kvb_log_level {
  KVB_LOG_DEBUG = 0,
  KVB_LOG_INFO = 1,
  KVB_LOG_WARN = 2,
  KVB_LOG_ERROR = 3
} kvb_log_level_t;

/* True when a struct of `type` handed over with struct_size `(p)->struct_size` has field f. */
#define KVB_HAS_FIELD(p, type, f) ((p)->struct_size >= offsetof(type, f) + sizeof(((type*)0)->f))

typedef struct kvb_auth kvb_auth_t;             /* one handshake in progress, owned by the host */
typedef struct kvb_dev_stream kvb_dev_stream_t; /* one device copy queue, owned by the host */
enum { KVB_AUTH_CLIENT = 1, KVB_AUTH_SERVER = 2 };
#define KVB_AUTH_MAX_MESSAGE 1024

/* Services the host hands to a plugin at create time, so a plugin never links the core.
 * The table and host_ctx stay valid until the plugin instance is destroyed. */
typedef struct kvb_host_services {
  uint32_t struct_size;
  void* host_ctx;
  /* One log line; `msg` has no trailing newline. */
  void (*log)(void* host_ctx, int32_t level, const char* plugin_name, const char* msg);
  /* Looks up configuration key `key` (e.g. "tcp.lanes_per_peer"). On success copies the
   * NUL-terminated value into buf and returns its length (excluding NUL). Returns -1 when the
   * key is unset, or -2 when buf is too small (buf untouched). */
  int32_t (*config_get)(void* host_ctx, const char* key, char* buf, uint32_t buf_len);
  /* Monotonic clock, nanoseconds. The one clock deadlines are expressed in. */
  uint64_t (*now_ns)(void* host_ctx);

  /* ---- ABI 1.2: identity and peer authentication -------------------------------------------
   * Present when struct_size covers them (KVB_HAS_FIELD). The host owns this process's identity
   * (node id, incarnation) and the cluster token; a transport never sees the token. Every
   * transport authenticates a new connection the same way: it carries the opaque messages these
   * functions produce, in order, over its own wire, and uses the connection only once auth_step
   * said KVB_OK. The exchange proves, in both directions and bound to fresh nonces and to the
   * transport's name, that each side holds the token, and that the server is the incarnation the
   * client asked for (KVB_ERR_STALE_PEER otherwise, before any byte of a request moves).
   * Thread-safe; one kvb_auth_t is used by one thread at a time. */

  /* This process's node id (borrowed, valid until the instance is destroyed) and incarnation. */
  const char* (*node_id)(void* host_ctx);
  uint64_t (*incarnation)(void* host_ctx);
  /* Starts one handshake. `transport` is the plugin's name (it labels the proofs, so a proof made
   * for one transport is not accepted by another). A client names the peer incarnation it means
   * to reach; a server passes NULL and 0. */
  kvb_status_t (*auth_begin)(void* host_ctx, const char* transport, int32_t role,
                             const char* expected_node_id, uint64_t expected_incarnation,
                             kvb_auth_t** out, char* err, uint32_t err_len);
  /* How many bytes the next message to receive has in total, given its first `have` bytes (read
   * that many, then ask again until the answer equals `have`). Never more than
   * KVB_AUTH_MAX_MESSAGE; -1 when the bytes are malformed. */
  int32_t (*auth_need)(void* host_ctx, kvb_auth_t* a, const uint8_t* buf, uint32_t have);
  /* Feeds one whole received message (a client's first call passes in = NULL) and writes the next
   * message to send into out (*out_len = 0: nothing to send). Returns
   *   KVB_IN_PROGRESS: send out, then receive the next message and call again;
   *   KVB_OK: send out if any; the peer is authenticated (auth_peer says who);
   *   an error (STALE_PEER, UNAUTHENTICATED, PROTOCOL, INTERNAL): the handshake is over and the
   *     connection must not be used; out may hold a refusal worth sending; err says who and why.
   * out_cap must be at least KVB_AUTH_MAX_MESSAGE. */
  kvb_status_t (*auth_step)(void* host_ctx, kvb_auth_t* a, const uint8_t* in, uint32_t in_len,
                            uint8_t* out, uint32_t out_cap, uint32_t* out_len, char* err,
                            uint32_t err_len);
  /* After KVB_OK: the authenticated peer's node id (NUL-terminated, truncated to cap) and
   * incarnation. */
  kvb_status_t (*auth_peer)(void* host_ctx, kvb_auth_t* a, char* node_id, uint32_t cap,
                            uint64_t* incarnation);
  /* Frees the handshake state (any state, any time after auth_begin succeeded). */
  void (*auth_end)(void* host_ctx, kvb_auth_t* a);

  /* ---- ABI 1.2: device memory -----------------------------------------------------------------
   * Present when struct_size covers them (KVB_HAS_FIELD). The host owns the CUDA driver (loaded
   * at run time; a plugin never links libcuda): a transport that moves bytes of CUDA regions
   * through host memory queues its copies here. Without a driver every call below answers
   * KVB_ERR_UNAVAILABLE with err naming libcuda (pinned_alloc: *out = NULL). Thread-safe; one
   * kvb_dev_stream_t is used by one thread at a time (copies on it run in the order queued).
   * Errors are named: a failed driver call is KVB_ERR_IO with the CUDA error's name in err. */

  /* Creates a copy queue on device `device_id` (its primary context). */
  kvb_status_t (*dev_stream_create)(void* host_ctx, int32_t device_id, kvb_dev_stream_t** out,
                                    char* err, uint32_t err_len);
  /* Waits for the stream's queued copies, then frees it and its tickets. */
  void (*dev_stream_destroy)(void* host_ctx, kvb_dev_stream_t* s);
  /* Queues a copy of len bytes from src to dst; the direction (host to device, device to host,
   * device to device) follows from the addresses (unified addressing). *ticket names the copy
   * until dev_copy_done/dev_copy_wait returned anything but KVB_IN_PROGRESS; neither buffer may
   * be touched until then. KVB_ERR_INVALID_ARGUMENT for a NULL pointer or len 0. */
  kvb_status_t (*dev_copy_async)(void* host_ctx, kvb_dev_stream_t* s, void* dst, const void* src,
                                 uint64_t len, uint64_t* ticket, char* err, uint32_t err_len);
  /* Never blocks: KVB_IN_PROGRESS while the copy runs, KVB_OK once its bytes are in dst, or the
   * error that ended it (KVB_ERR_IO naming the CUDA error); KVB_ERR_NOT_FOUND for a ticket this
   * stream does not hold (never issued, or already answered). */
  kvb_status_t (*dev_copy_done)(void* host_ctx, kvb_dev_stream_t* s, uint64_t ticket, char* err,
                                uint32_t err_len);
  /* Like dev_copy_done, but waits until the copy ends or now_ns() passes deadline_ns:
   * KVB_ERR_DEADLINE_EXCEEDED then (the ticket stays valid; the copy may still run, so its
   * buffers stay untouchable until a later call answers). */
  kvb_status_t (*dev_copy_wait)(void* host_ctx, kvb_dev_stream_t* s, uint64_t ticket,
                                uint64_t deadline_ns, char* err, uint32_t err_len);
  /* Page-locked host memory (fast, asynchronous copies); freed with pinned_free only. */
  kvb_status_t (*pinned_alloc)(void* host_ctx, uint64_t len, void** out);
  void (*pinned_free)(void* host_ctx, void* p);
} kvb_host_services_t;

/* What kvb_plugin_query() returns. Static storage, owned by the plugin. */
typedef struct kvb_plugin_descriptor {
  uint32_t struct_size;
  uint16_t abi_major; /* the ABI this plugin was built against */
  uint16_t abi_minor;
  const char* name;    /* short, unique per kind: "tcp", "ucx", "dram" */
  const char* version; /* the plugin's own version, free text */
  int32_t kind;        /* kvb_plugin_kind_t */
  uint32_t reserved;
  uint64_t caps; /* KVB_TCAP_* for transports, KVB_SCAP_* for storage */
  /* Cheap check that the plugin can run on this machine (library present, device present).
   * Returns KVB_OK, or KVB_ERR_UNAVAILABLE with a human reason written into `reason`. */
  kvb_status_t (*probe)(char* reason, uint32_t reason_len);
  /* const kvb_transport_ops_t* or const kvb_storage_ops_t*, according to `kind`. */
  const void* ops;
} kvb_plugin_descriptor_t;

/* The one exported symbol. Returns NULL if the plugin cannot serve the host's ABI major. */
typedef const kvb_plugin_descriptor_t* (*kvb_plugin_query_fn)(uint16_t host_abi_major,
                                                              uint16_t host_abi_minor);

/* Copies a message into a caller buffer, always NUL-terminated, truncating if needed. */
static inline void kvb_copy_message(char* buf, uint32_t buf_len, const char* msg) {
  uint32_t i = 0;
  if (buf == NULL || buf_len == 0) return;
  if (msg != NULL) {
    for (; i + 1 < buf_len && msg[i] != '\0'; ++i) buf[i] = msg[i];
  }
  buf[i] = '\0';
}

#ifdef __cplusplus
}
#endif

#endif /* KVBRIDGE_PLUGIN_ABI_H_ */
