/*
 * Transport plugins that are each wrong (or unusable) in exactly one way, for the loader tests.
 * One source, compiled once per case with -DKVB_CASE_<NAME>; see CMakeLists.txt. Apart from the
 * defect each is a well-formed ABI 1.0 transport whose ops answer UNSUPPORTED: they are loaded
 * and inspected, never run.
 */
#include "kvbridge/plugin/transport.h"

#if defined(KVB_CASE_ABI_MAJOR)
#define CASE_NAME "bad_abi_major"
#elif defined(KVB_CASE_NO_QUERY)
#define CASE_NAME "no_query"
#elif defined(KVB_CASE_QUERY_NULL)
#define CASE_NAME "query_null"
#elif defined(KVB_CASE_NULL_REQUIRED)
#define CASE_NAME "null_required"
#elif defined(KVB_CASE_CAPS_NO_RW)
#define CASE_NAME "caps_no_rw"
#elif defined(KVB_CASE_NULL_OPTIONAL)
#define CASE_NAME "null_optional"
#elif defined(KVB_CASE_PROBE_UNAVAILABLE)
#define CASE_NAME "probe_unavailable"
#elif defined(KVB_CASE_MISSING_DEP)
#define CASE_NAME "missing_dep"
/* Lives in a directory neither the loader nor the dynamic linker searches. */
int kvbtest_helper_value(void);
#else
#error "define one KVB_CASE_*"
#endif

static kvb_status_t Create(const kvb_host_services_t* host, const kvb_transport_params_t* params,
                           kvb_transport_t** out, char* err, uint32_t err_len) {
  (void)host;
  (void)params;
  (void)out;
  kvb_copy_message(err, err_len, CASE_NAME ": a loader test plugin, not meant to run");
  return KVB_ERR_UNSUPPORTED;
}
static void Destroy(kvb_transport_t* t) { (void)t; }
static int32_t GetEndpoints(kvb_transport_t* t, char* buf, uint32_t buf_len) {
  (void)t;
  kvb_copy_message(buf, buf_len, "");
  return 0;
}
static kvb_status_t RegisterMemory(kvb_transport_t* t, const kvb_region_t* r, uint8_t* rkey,
                                   uint32_t rkey_cap, uint32_t* rkey_len) {
  (void)t;
  (void)r;
  (void)rkey;
  (void)rkey_cap;
  (void)rkey_len;
  return KVB_ERR_UNSUPPORTED;
}
static kvb_status_t DeregisterMemory(kvb_transport_t* t, uint64_t segment_id) {
  (void)t;
  (void)segment_id;
  return KVB_ERR_UNSUPPORTED;
}
static kvb_status_t AddPeer(kvb_transport_t* t, const kvb_peer_info_t* info, kvb_tpeer_t** out,
                            char* err, uint32_t err_len) {
  (void)t;
  (void)info;
  (void)out;
  kvb_copy_message(err, err_len, "unsupported");
  return KVB_ERR_UNSUPPORTED;
}
static kvb_status_t UpdatePeer(kvb_transport_t* t, kvb_tpeer_t* p, const kvb_peer_info_t* info,
                               char* err, uint32_t err_len) {
  (void)t;
  (void)p;
  (void)info;
  (void)err;
  (void)err_len;
  return KVB_ERR_UNSUPPORTED;
}
static void RemovePeer(kvb_transport_t* t, kvb_tpeer_t* p) {
  (void)t;
  (void)p;
}
#if !defined(KVB_CASE_NULL_REQUIRED)
static kvb_status_t Post(kvb_transport_t* t, kvb_tpeer_t* p, const kvb_xfer_op_t* ops,
                         uint32_t op_size, uint32_t count, const kvb_post_opts_t* opts,
                         kvb_treq_t** out, char* err, uint32_t err_len) {
  (void)t;
  (void)p;
  (void)ops;
  (void)op_size;
  (void)count;
  (void)opts;
  (void)out;
  kvb_copy_message(err, err_len, "unsupported");
  return KVB_ERR_UNSUPPORTED;
}
#endif
static kvb_status_t Poll(kvb_transport_t* t, kvb_treq_t* r, kvb_status_t* op_status,
                         uint32_t op_status_len, char* err, uint32_t err_len) {
  (void)t;
  (void)r;
  (void)op_status;
  (void)op_status_len;
  kvb_copy_message(err, err_len, "unsupported");
  return KVB_ERR_UNSUPPORTED;
}
static void Cancel(kvb_transport_t* t, kvb_treq_t* r) {
  (void)t;
  (void)r;
}
static void Release(kvb_transport_t* t, kvb_treq_t* r) {
  (void)t;
  (void)r;
}

static kvb_status_t Probe(char* reason, uint32_t reason_len) {
#if defined(KVB_CASE_PROBE_UNAVAILABLE)
  kvb_copy_message(reason, reason_len, "no such device");
  return KVB_ERR_UNAVAILABLE;
#elif defined(KVB_CASE_MISSING_DEP)
  kvb_copy_message(reason, reason_len, "");
  return kvbtest_helper_value() == 42 ? KVB_OK : KVB_ERR_UNAVAILABLE;
#else
  kvb_copy_message(reason, reason_len, "");
  return KVB_OK;
#endif
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
#if defined(KVB_CASE_NULL_REQUIRED)
    .post = NULL,
#else
    .post = Post,
#endif
    .poll = Poll,
    .cancel = Cancel,
    .release = Release,
#if defined(KVB_CASE_NULL_OPTIONAL)
    .get_stats = NULL,
#else
    .get_stats = kvb_transport_stats_unsupported,
#endif
    .instance_caps = kvb_transport_instance_caps_all,
};

static const kvb_plugin_descriptor_t kDescriptor = {
    .struct_size = sizeof(kvb_plugin_descriptor_t),
#if defined(KVB_CASE_ABI_MAJOR)
    .abi_major = 2,
#else
    .abi_major = KVB_ABI_MAJOR,
#endif
    .abi_minor = 0,
    .name = CASE_NAME,
    .version = "0",
    .kind = KVB_PLUGIN_TRANSPORT,
    .reserved = 0,
#if defined(KVB_CASE_CAPS_NO_RW)
    .caps = KVB_TCAP_HOST_MEM,
#else
    .caps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM,
#endif
    .probe = Probe,
    .ops = &kOps,
};

#if defined(KVB_CASE_NO_QUERY)
/* Exports something, just not the query symbol. */
KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_describe(void) { return &kDescriptor; }
#else
KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(uint16_t host_abi_major,
                                                                  uint16_t host_abi_minor) {
  (void)host_abi_minor;
#if defined(KVB_CASE_QUERY_NULL)
  (void)host_abi_major;
  (void)kDescriptor; /* well-formed, just never handed out */
  return NULL;
#elif defined(KVB_CASE_ABI_MAJOR)
  /* Deliberately returns its descriptor whatever the host speaks, as a stale build would. */
  (void)host_abi_major;
  return &kDescriptor;
#else
  return host_abi_major == KVB_ABI_MAJOR ? &kDescriptor : NULL;
#endif
}
#endif
