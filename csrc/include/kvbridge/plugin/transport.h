/*
 * kvbridge transport plugin ABI: one-sided READ/WRITE between registered memory of two
 * processes. A transport moves bytes; the core (transfer engine) owns identity, the peer
 * directory, circuit breakers and batch bookkeeping, and calls these ops.
 *
 * Contract every transport follows (docs/transfer-engine.md, docs/plugin-abi.md):
 *  - Identity: connections are made to a peer *incarnation*. The handshake carries both sides'
 *    (node id, incarnation); when the process answering is not the incarnation the host asked
 *    for, ops fail with KVB_ERR_STALE_PEER and not one byte is written into that process.
 *  - Deadlines: every posted request reaches a final state by its deadline. A request whose
 *    peer stops moving bytes for progress_timeout fails with KVB_ERR_PROGRESS_TIMEOUT.
 *  - Isolation: per-peer lanes and queues; a dead or frozen peer never delays other peers.
 *  - Bounds: connections per peer, and what is queued per peer, are bounded: bytes, and also
 *    whatever per-op state the transport keeps (the tcp plugin counts slices), so that many
 *    tiny ops cannot grow it where their bytes never reach the byte bound; posts beyond a
 *    queued bound fail at once with KVB_ERR_BACKPRESSURE and queue nothing.
 *  - Bad input: every incoming request is checked against the registered regions before any
 *    memory is touched; malformed frames close that connection with a logged reason.
 *
 * Thread-safety: all ops on one kvb_transport_t may be called concurrently from any thread,
 * except that destroy() must not race with anything else on that instance.
 *
 * Pure C99.
 */
#ifndef KVBRIDGE_PLUGIN_TRANSPORT_H_
#define KVBRIDGE_PLUGIN_TRANSPORT_H_

#include "kvbridge/plugin/abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Capability flags (kvb_plugin_descriptor_t.caps) for transport plugins. */
#define KVB_TCAP_READ ((uint64_t)1 << 0)     /* one-sided READ */
#define KVB_TCAP_WRITE ((uint64_t)1 << 1)    /* one-sided WRITE */
#define KVB_TCAP_HOST_MEM ((uint64_t)1 << 2) /* host (CPU) memory regions */
#define KVB_TCAP_CUDA_MEM ((uint64_t)1 << 3) /* CUDA device memory regions */
#define KVB_TCAP_STATS ((uint64_t)1 << 4)    /* get_stats is implemented (not the stub) */
/* ABI 1.2: used only when named in EngineOptions::transports, never picked up by default (a
 * transport that costs every process something, or is not yet the better path). */
#define KVB_TCAP_OPT_IN ((uint64_t)1 << 5)
/* ABI 1.2: reaches a peer on the same host (the same host key in its descriptor) through shared
 * memory or cross-memory attach, faster than its network path: for such a peer the engine tries
 * this transport before the others. A host that does not know the bit ignores it. */
#define KVB_TCAP_LOCAL_SHM ((uint64_t)1 << 6)
/* 1.3: CUDA memory moves without a host staging copy (cuda_copy/cuda_ipc, GPUDirect RDMA). A
 * transport with CUDA_MEM but not CUDA_DIRECT stages device bytes through host memory; for an
 * op on device memory the engine tries CUDA_DIRECT paths first. */
#define KVB_TCAP_CUDA_DIRECT ((uint64_t)1 << 7)
/* 1.4: takes the CRC-32C of an op's bytes as they move (a READ's as they land in local memory, a
 * WRITE's as they leave it), when the op asks for it (KVB_XOP_CRC32C and kvb_xfer_op_t.crc): a
 * reader that verifies what it received, or a writer that records the checksum of what it wrote,
 * needs no second pass over its buffer. */
#define KVB_TCAP_OP_CRC32C ((uint64_t)1 << 8)
#define KVB_TCAP_KNOWN_MASK ((uint64_t)0x1ff)

typedef enum kvb_mem_kind { KVB_MEM_HOST = 1, KVB_MEM_CUDA = 2 } kvb_mem_kind_t;

typedef enum kvb_opcode { KVB_OP_READ = 1, KVB_OP_WRITE = 2 } kvb_opcode_t;

typedef struct kvb_transport kvb_transport_t; /* one plugin instance (opaque) */
typedef struct kvb_tpeer kvb_tpeer_t;         /* a peer incarnation known to the instance */
typedef struct kvb_treq kvb_treq_t;           /* one posted request (opaque) */

typedef struct kvb_transport_params {
  uint32_t struct_size;
  const char* node_id;  /* this process's node id */
  uint64_t incarnation; /* this process's incarnation (random per start) */
  /* Where to listen: comma-separated "host:port" list, one entry per NIC; port 0 = pick one.
   * NULL or "" lets the transport choose (loopback for tcp). */
  const char* listen;
  /* Shared secret for peer authentication; NULL or "" = no authentication. */
  const char* cluster_token;
} kvb_transport_params_t;

typedef struct kvb_region {
  uint32_t struct_size;
  uint32_t mem_kind;   /* kvb_mem_kind_t */
  uint64_t segment_id; /* chosen by the host, unique within this process */
  void* addr;
  uint64_t length;
  int32_t device_id; /* CUDA device for KVB_MEM_CUDA, -1 otherwise */
  /* 1.5: where register_memory may set KVB_REG_* bits (the host zeroes *reg_flags first). NULL,
   * or beyond struct_size, on a host that takes none: a transport then must not register a
   * region in a way that needs one. */
  uint32_t* reg_flags;
} kvb_region_t;

/* kvb_region_t.reg_flags bits (1.5). */
/* Peers cannot reach the region through this transport (the verbs transport stages CUDA memory
 * its NIC cannot address through host buffers: its own ops can use the region, a peer's RDMA
 * cannot). The host keeps the key out of its descriptor, so peers choose another path to the
 * region; its own ops may still use the region as their local memory over this transport. */
#define KVB_REG_LOCAL_ONLY ((uint32_t)1 << 0)

/* One remote segment as published in the peer's descriptor. */
typedef struct kvb_peer_segment {
  uint32_t struct_size;
  uint32_t mem_kind;
  uint64_t segment_id;
  uint64_t length;
  const uint8_t* rkey; /* what the peer's transport returned from register_memory; may be empty */
  uint32_t rkey_len;
} kvb_peer_segment_t;

typedef struct kvb_peer_info {
  uint32_t struct_size;
  const char* node_id;
  uint64_t incarnation;
  /* This transport's endpoints as the peer published them (get_endpoints on its side). */
  const char* endpoints;
  /* num_segments elements, each segment_size bytes apart (the host's sizeof(kvb_peer_segment_t);
   * a plugin reads only the fields that fit in it). */
  const kvb_peer_segment_t* segments;
  uint32_t num_segments;
  uint32_t segment_size;
} kvb_peer_info_t;

/* 1.4: where a transport with KVB_TCAP_OP_CRC32C leaves the checksum of an op's bytes. */
typedef struct kvb_op_crc {
  uint32_t crc32c;   /* CRC-32C (Castagnoli) of the bytes the op moved, as in local memory */
  uint32_t computed; /* set to 1 by the transport once crc32c holds them; the host posts 0 */
} kvb_op_crc_t;

/* kvb_xfer_op_t.flags (1.4; the field was `reserved`, always 0, before). A transport ignores
 * bits it does not know, and a host sets a bit only for a transport that declares its cap. */
#define KVB_XOP_CRC32C ((uint32_t)1 << 0) /* the op asks for the CRC-32C of its bytes in `crc` */

/* One op of a request. Arrays of ops are passed with their element size (op_size) so the
 * struct can grow in a minor version: a field at or past op_size is absent (a 1.0-1.3 host
 * passes KVB_XFER_OP_SIZE_1_0 bytes). */
typedef struct kvb_xfer_op {
  uint32_t opcode;        /* kvb_opcode_t */
  uint32_t flags;         /* KVB_XOP_* (1.4) */
  uint64_t local_segment; /* local region containing [local_addr, local_addr + length) */
  void* local_addr;
  uint64_t length;
  uint64_t remote_segment;
  uint64_t remote_offset;
  /* 1.4, with KVB_XOP_CRC32C: a transport with KVB_TCAP_OP_CRC32C writes the CRC-32C of the
   * bytes the op moved here (a READ's as they landed in [local_addr, +length), a WRITE's as it
   * sent them from there), and sets `computed`, before the request becomes final, for an op
   * that ends OK. It may leave `computed` 0 when it cannot (bytes staged through a bounce
   * buffer); nothing is written for an op that fails. Owned by the host, valid until the
   * request is released; read only once poll() says final. */
  kvb_op_crc_t* crc;
} kvb_xfer_op_t;

/* The element size of kvb_xfer_op_t up to ABI 1.3 (no `crc`). */
#define KVB_XFER_OP_SIZE_1_0 ((uint32_t)offsetof(kvb_xfer_op_t, crc))

typedef struct kvb_post_opts {
  uint32_t struct_size;
  uint64_t deadline_ns;         /* absolute, host monotonic clock (now_ns); 0 = none */
  uint64_t progress_timeout_ns; /* 0 = transport default */
  /* Called once, from any thread, when the request becomes final (also after cancel); it may
   * run before post() returns, even from inside post(). Must be cheap and must not call back
   * into the transport. poll() reports the request final only after on_complete has returned,
   * so release() never races with it. May be NULL. */
  void (*on_complete)(void* user);
  void* user;
} kvb_post_opts_t;

typedef struct kvb_transport_stats {
  uint32_t struct_size;
  uint64_t connections_open;        /* outbound lanes currently established */
  uint64_t connections_opened;      /* total outbound lanes ever opened */
  uint64_t connections_closed_idle; /* outbound lanes closed for idleness */
  uint64_t connections_evicted;     /* outbound lanes closed after an error */
  uint64_t inbound_open;            /* inbound connections currently open */
  uint64_t bytes_written;           /* payload bytes of completed WRITE ops (initiator side) */
  uint64_t bytes_read;              /* payload bytes of completed READ ops (initiator side) */
  uint64_t frames_rejected;         /* inbound requests refused (bounds, malformed, auth) */
  uint64_t queued_bytes;            /* bytes posted and not yet final, all peers */
  /* 1.5: how device memory is moved. CUDA regions registered so that the transport moves their
   * bytes without a host copy (cuda_copy/cuda_ipc, dma-buf, nvidia-peermem), and so that it
   * copies them through host buffers (staging); bytes of the device <-> host buffer copies
   * queued (either side of an op). Counters since create. */
  uint64_t device_regions_direct;
  uint64_t device_regions_staged;
  uint64_t device_bytes_staged;
} kvb_transport_stats_t;

typedef struct kvb_transport_ops {
  uint32_t struct_size;

  /* Creates an instance, binding its listeners. On failure returns an error, writes the reason
   * into err and leaves *out untouched. */
  kvb_status_t (*create)(const kvb_host_services_t* host, const kvb_transport_params_t* params,
                         kvb_transport_t** out, char* err, uint32_t err_len);
  /* Stops all threads, closes all connections, fails outstanding requests (CANCELLED) and frees
   * everything the instance created. Requests not yet released must not be used afterwards. */
  void (*destroy)(kvb_transport_t* t);
  /* Writes the endpoints peers dial, as comma-separated text with the ports actually bound.
   * Returns the length, or -2 if buf is too small. */
  int32_t (*get_endpoints)(kvb_transport_t* t, char* buf, uint32_t buf_len);

  /* Makes a region reachable by peers. Writes an opaque remote key (may be empty) into rkey,
   * setting *rkey_len; peers get it through the host's descriptor. */
  kvb_status_t (*register_memory)(kvb_transport_t* t, const kvb_region_t* region, uint8_t* rkey,
                                  uint32_t rkey_cap, uint32_t* rkey_len);
  /* After return, no incoming request reads or writes the region (in-flight ones have finished
   * or been refused). May block while such a request finishes, at most about one progress
   * timeout. NOT_FOUND if the segment is unknown. */
  kvb_status_t (*deregister_memory)(kvb_transport_t* t, uint64_t segment_id);

  /* Learns a peer incarnation. Connections are made lazily. */
  kvb_status_t (*add_peer)(kvb_transport_t* t, const kvb_peer_info_t* info, kvb_tpeer_t** out,
                           char* err, uint32_t err_len);
  /* Same incarnation, new segments or endpoints. On error the peer keeps its old information
   * and err says what was wrong. */
  kvb_status_t (*update_peer)(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_peer_info_t* info,
                              char* err, uint32_t err_len);
  /* Fails the peer's outstanding requests (CANCELLED), closes its connections, frees it. */
  void (*remove_peer)(kvb_transport_t* t, kvb_tpeer_t* peer);

  /* Queues `count` ops to one peer. On KVB_OK *out is a request the host must release. On any
   * error nothing was queued (e.g. BACKPRESSURE, INVALID_ARGUMENT) and *out is untouched. */
  kvb_status_t (*post)(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_xfer_op_t* ops,
                       uint32_t op_size, uint32_t count, const kvb_post_opts_t* opts,
                       kvb_treq_t** out, char* err, uint32_t err_len);
  /* KVB_IN_PROGRESS while any op is unfinished. Once final: KVB_OK, or the error of the failed op
   * with the lowest index, with its message in err. op_status (may be NULL) receives one code per
   * op (IN_PROGRESS for an unfinished op). Never blocks. */
  kvb_status_t (*poll)(kvb_transport_t* t, kvb_treq_t* req, kvb_status_t* op_status,
                       uint32_t op_status_len, char* err, uint32_t err_len);
  /* Makes the request final: unfinished ops become CANCELLED. When cancel returns, the transport
   * no longer touches any of the request's local memory. Idempotent. */
  void (*cancel)(kvb_transport_t* t, kvb_treq_t* req);
  /* Frees a request. REQUIRES: the request is final (poll said so, or cancel returned). */
  void (*release)(kvb_transport_t* t, kvb_treq_t* req);

  /* Optional (KVB_TCAP_STATS): counters for tests and metrics. */
  kvb_status_t (*get_stats)(kvb_transport_t* t, kvb_transport_stats_t* stats);

  /* ABI 1.3, optional (kvb_transport_instance_caps_all when not implemented): the caps this
   * instance has, which may be fewer than the descriptor's, e.g. CUDA_MEM only when the library
   * the plugin loaded can move device memory on this machine. Called once, right after create.
   * The host uses (descriptor caps & the result): an instance can drop a bit, never add one. A
   * host reads this slot only when struct_size covers it. */
  uint64_t (*instance_caps)(kvb_transport_t* t);
} kvb_transport_ops_t;

/* A stub for optional slots a transport does not implement. */
static inline kvb_status_t kvb_transport_stats_unsupported(kvb_transport_t* t,
                                                           kvb_transport_stats_t* stats) {
  (void)t;
  (void)stats;
  return KVB_ERR_UNSUPPORTED;
}

/* The stub for instance_caps: the instance has every cap its descriptor declares. */
static inline uint64_t kvb_transport_instance_caps_all(kvb_transport_t* t) {
  (void)t;
  return ~(uint64_t)0;
}

#ifdef __cplusplus
}
#endif

#endif /* KVBRIDGE_PLUGIN_TRANSPORT_H_ */
