/*
 * example_loopback_c: a complete kvbridge transport plugin in one C file, on the C ABI alone
 * (examples/transport_plugin/ is the same plugin in C++ on the plugin SDK).
 *
 * It reaches exactly one peer, its own process (same node id and incarnation), and completes
 * every request inside post() with a bounds-checked memmove. Real transports queue the work
 * and finish it on their own threads; the ABI rules are the same: fill the ops table by name,
 * point optional ops to a stub, copy results into caller buffers, never let a request outlive
 * its deadline, free what you allocate.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvbridge/plugin/transport.h"

#define MAX_REGIONS 64

struct kvb_transport {
  pthread_mutex_t mu; /* guards regions */
  const kvb_host_services_t* host;
  char endpoint[160];
  uint64_t incarnation;
  kvb_region_t regions[MAX_REGIONS];
  uint32_t num_regions;
};
struct kvb_tpeer {
  uint64_t incarnation;
};
struct kvb_treq {
  kvb_status_t status;
  uint32_t count;
  kvb_status_t op_status[]; /* one per op */
};

static kvb_status_t Create(const kvb_host_services_t* host, const kvb_transport_params_t* params,
                           kvb_transport_t** out, char* err, uint32_t err_len) {
  kvb_transport_t* t = calloc(1, sizeof(*t));
  if (t == NULL) return KVB_ERR_INTERNAL;
  pthread_mutex_init(&t->mu, NULL);
  t->host = host;
  t->incarnation = params->incarnation;
  snprintf(t->endpoint, sizeof(t->endpoint), "loopback:%s", params->node_id);
  *out = t;
  (void)err, (void)err_len;
  return KVB_OK;
}
static void Destroy(kvb_transport_t* t) {
  pthread_mutex_destroy(&t->mu);
  free(t);
}
static int32_t GetEndpoints(kvb_transport_t* t, char* buf, uint32_t buf_len) {
  size_t n = strlen(t->endpoint);
  if (buf == NULL || n + 1 > buf_len) return -2;
  memcpy(buf, t->endpoint, n + 1);
  return (int32_t)n;
}
static kvb_status_t RegisterMemory(kvb_transport_t* t, const kvb_region_t* r, uint8_t* rkey,
                                   uint32_t rkey_cap, uint32_t* rkey_len) {
  kvb_status_t st = KVB_OK;
  if (r->mem_kind != KVB_MEM_HOST) return KVB_ERR_UNSUPPORTED;
  pthread_mutex_lock(&t->mu);
  if (t->num_regions == MAX_REGIONS) st = KVB_ERR_NO_SPACE;
  for (uint32_t i = 0; st == KVB_OK && i < t->num_regions; ++i) {
    if (t->regions[i].segment_id == r->segment_id) st = KVB_ERR_ALREADY_EXISTS;
  }
  if (st == KVB_OK) t->regions[t->num_regions++] = *r;
  pthread_mutex_unlock(&t->mu);
  if (rkey_len != NULL) *rkey_len = 0; /* no remote key needed */
  (void)rkey, (void)rkey_cap;
  return st;
}
static kvb_status_t DeregisterMemory(kvb_transport_t* t, uint64_t segment_id) {
  kvb_status_t st = KVB_ERR_NOT_FOUND;
  pthread_mutex_lock(&t->mu);
  for (uint32_t i = 0; i < t->num_regions; ++i) {
    if (t->regions[i].segment_id != segment_id) continue;
    t->regions[i] = t->regions[--t->num_regions];
    st = KVB_OK;
    break;
  }
  pthread_mutex_unlock(&t->mu);
  return st;
}
static kvb_status_t AddPeer(kvb_transport_t* t, const kvb_peer_info_t* info, kvb_tpeer_t** out,
                            char* err, uint32_t err_len) {
  if (info->endpoints == NULL || strcmp(info->endpoints, t->endpoint) != 0) {
    kvb_copy_message(err, err_len, "example_loopback_c reaches only its own process");
    return KVB_ERR_UNSUPPORTED;
  }
  *out = malloc(sizeof(**out));
  if (*out == NULL) return KVB_ERR_INTERNAL;
  (*out)->incarnation = info->incarnation;
  return KVB_OK;
}
static kvb_status_t UpdatePeer(kvb_transport_t* t, kvb_tpeer_t* p, const kvb_peer_info_t* info,
                               char* err, uint32_t err_len) {
  (void)t, (void)p, (void)info, (void)err, (void)err_len;
  return KVB_OK; /* nothing cached */
}
static void RemovePeer(kvb_transport_t* t, kvb_tpeer_t* p) {
  (void)t;
  free(p); /* requests finish inside post(), so none is outstanding */
}
static kvb_status_t RunOp(kvb_transport_t* t, const kvb_xfer_op_t* op) {
  const kvb_region_t* remote = NULL;
  for (uint32_t i = 0; i < t->num_regions; ++i) {
    if (t->regions[i].segment_id == op->remote_segment) remote = &t->regions[i];
  }
  if (remote == NULL) return KVB_ERR_NOT_REGISTERED;
  if (op->remote_offset > remote->length || op->length > remote->length - op->remote_offset) {
    return KVB_ERR_OUT_OF_BOUNDS;
  }
  uint8_t* at = (uint8_t*)remote->addr + op->remote_offset;
  if (op->opcode == KVB_OP_WRITE)
    memmove(at, op->local_addr, op->length);
  else
    memmove(op->local_addr, at, op->length);
  return KVB_OK;
}
static kvb_status_t Post(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_xfer_op_t* ops,
                         uint32_t op_size, uint32_t count, const kvb_post_opts_t* opts,
                         kvb_treq_t** out, char* err, uint32_t err_len) {
  if (count == 0 || op_size < sizeof(kvb_xfer_op_t)) return KVB_ERR_INVALID_ARGUMENT;
  for (uint32_t i = 0; i < count; ++i) { /* a malformed op refuses the request: nothing runs */
    const kvb_xfer_op_t* op = (const kvb_xfer_op_t*)((const uint8_t*)ops + (size_t)i * op_size);
    if ((op->opcode != KVB_OP_READ && op->opcode != KVB_OP_WRITE) || op->length == 0) {
      kvb_copy_message(err, err_len, "example_loopback_c: bad opcode or zero length");
      return KVB_ERR_INVALID_ARGUMENT;
    }
  }
  kvb_treq_t* req = malloc(sizeof(*req) + count * sizeof(kvb_status_t));
  if (req == NULL) return KVB_ERR_INTERNAL;
  req->status = KVB_OK;
  req->count = count;
  uint64_t now = t->host->now_ns(t->host->host_ctx);
  pthread_mutex_lock(&t->mu);
  for (uint32_t i = 0; i < count; ++i) {
    /* Ops are read with the caller's element size so the struct can grow in a minor. */
    const kvb_xfer_op_t* op = (const kvb_xfer_op_t*)((const uint8_t*)ops + (size_t)i * op_size);
    kvb_status_t st = peer->incarnation != t->incarnation ? KVB_ERR_STALE_PEER
                      : opts && opts->deadline_ns && now >= opts->deadline_ns
                          ? KVB_ERR_DEADLINE_EXCEEDED
                          : RunOp(t, op);
    req->op_status[i] = st;
    if (req->status == KVB_OK) req->status = st;
  }
  pthread_mutex_unlock(&t->mu);
  if (opts != NULL && opts->on_complete != NULL) opts->on_complete(opts->user);
  *out = req;
  return KVB_OK;
}
static kvb_status_t Poll(kvb_transport_t* t, kvb_treq_t* req, kvb_status_t* op_status,
                         uint32_t op_status_len, char* err, uint32_t err_len) {
  for (uint32_t i = 0; op_status != NULL && i < op_status_len && i < req->count; ++i) {
    op_status[i] = req->op_status[i];
  }
  if (req->status != KVB_OK) kvb_copy_message(err, err_len, "example_loopback_c: op failed");
  (void)t;
  return req->status;
}
static void Cancel(kvb_transport_t* t, kvb_treq_t* req) { (void)t, (void)req; } /* already final */
static void Release(kvb_transport_t* t, kvb_treq_t* req) {
  (void)t;
  free(req);
}
static kvb_status_t Probe(char* reason, uint32_t reason_len) {
  kvb_copy_message(reason, reason_len, ""); /* nothing to check: runs everywhere */
  return KVB_OK;
}

static const kvb_transport_ops_t kOps = {
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
    .get_stats = kvb_transport_stats_unsupported,     /* optional: the ABI's stub, never NULL */
    .instance_caps = kvb_transport_instance_caps_all, /* optional (ABI 1.3): the stub */
};

static const kvb_plugin_descriptor_t kDescriptor = {
    .struct_size = sizeof(kvb_plugin_descriptor_t),
    .abi_major = KVB_ABI_MAJOR,
    .abi_minor = KVB_ABI_MINOR,
    .name = "example_loopback_c",
    .version = "1.0",
    .kind = KVB_PLUGIN_TRANSPORT,
    .caps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM,
    .probe = Probe,
    .ops = &kOps,
};

KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(uint16_t host_abi_major,
                                                                  uint16_t host_abi_minor) {
  (void)host_abi_minor; /* any 1.x host can use a 1.0 plugin */
  return host_abi_major == KVB_ABI_MAJOR ? &kDescriptor : NULL;
}
