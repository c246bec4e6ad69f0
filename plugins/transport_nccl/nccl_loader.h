// kvbridge::nccl: NCCL loaded at run time with dlopen, so the NCCL transport plugin builds and
// loads on a machine without NCCL or a GPU and says precisely why it cannot run there
// (docs/transports/nccl.md). No NCCL or CUDA header is needed to build: the few types and values
// the transport uses are declared here, with the same layout and values as nccl.h (NCCL 2.x).
//
// LoadNccl(candidates) tries each library path in order and returns the first whose every entry
// point is there and whose version is at least 2.18; LoadNcclOnce() does it once per process on
// DefaultNcclCandidates(). ProbeNccl() then asks the CUDA driver (libcuda.so.1, or
// $KVBRIDGE_CUDA_DRIVER as in csrc/core/cuda_driver.cc) whether there is a GPU for NCCL to use.
//
// Thread-safety: every function may be called from any thread. A loaded Nccl is immutable and
// lives until this module is unloaded or the process exits, for good once a transport runs on
// it (KeepNcclLoaded); NCCL's own entry points have NCCL's thread-safety rules.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/plugin/sdk/common.hpp"

namespace kvbridge::nccl {

namespace sdk = kvbridge::plugin::sdk;

// ---- the NCCL and CUDA types the transport uses (layouts and values as in nccl.h) -------------
struct ncclComm;               // opaque
using ncclComm_t = ncclComm*;  // NOLINT(readability-identifier-naming): NCCL's own names
using ncclResult_t = int;      // NOLINT(readability-identifier-naming)
using ncclDataType_t = int;    // NOLINT(readability-identifier-naming)
using cudaStream_t = void*;    // NOLINT(readability-identifier-naming)
struct ncclUniqueId {          // NOLINT(readability-identifier-naming)
  char internal[128];          // NCCL_UNIQUE_ID_BYTES
};
static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId is NCCL_UNIQUE_ID_BYTES (128) bytes");

inline constexpr ncclResult_t ncclSuccess = 0;
inline constexpr ncclResult_t ncclInProgress = 7;  // non-blocking communicators (NCCL >= 2.14)
inline constexpr ncclDataType_t ncclUint8 = 1;

// The first fields of nccl.h's ncclConfig_t, up to `splitShare`: the fields NCCL 2.18, the
// oldest NCCL the transport loads, knows. Later versions append fields. NCCL reads a config
// this way (parseCommConfig in NCCL's init.cc, 2.18 to 2.30): it starts from its own
// NCCL_CONFIG_INITIALIZER, copies min(config->size, its sizeof(ncclConfig_t)) bytes over it,
// refuses a wrong `magic`, then resets to NCCL's default every field newer than the config's
// `version`. So a config that says version 2.18 and the size of these fields is accepted by
// every NCCL >= 2.18, which reads exactly these fields and takes its defaults for the rest.
// tests/nccl/test_nccl_config_layout.cc checks offsets, sizes and values against a real nccl.h
// when the build machine has one (the plugin itself never includes nccl.h).
struct ncclConfig_t {  // NOLINT(readability-identifier-naming)
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;   // NCCL >= 2.17
  int minCTAs;          // NCCL >= 2.17
  int maxCTAs;          // NCCL >= 2.17
  const char* netName;  // NCCL >= 2.17
  int splitShare;       // NCCL >= 2.18
};
// The bytes of ncclConfig_t that MakeNcclConfig hands NCCL (`size`): through splitShare, not the
// struct's tail padding, which a newer NCCL would otherwise read as its next field.
inline constexpr size_t kNcclConfigBytes = offsetof(ncclConfig_t, splitShare) + sizeof(int);
inline constexpr unsigned int kNcclConfigMagic = 0xcafebeef;  // NCCL_CONFIG_INITIALIZER's magic
inline constexpr unsigned int kNcclConfigVersion = 21800;     // NCCL_VERSION(2, 18, 0)
// NCCL_CONFIG_INITIALIZER's values for these fields (INT_MIN, NULL: "NCCL's default"), with
// `blocking` as given (0: a non-blocking communicator); size kNcclConfigBytes, version 2.18.
ncclConfig_t MakeNcclConfig(int blocking);

// The oldest NCCL the transport accepts: 2.18.0 (ncclCommGetAsyncError, ncclCommAbort on a hung
// communicator, and the version-code scheme of NCCL >= 2.9).
inline constexpr int kMinNcclVersionCode = 21800;

// NCCL's version code as "major.minor.patch": major*10000 + minor*100 + patch for NCCL >= 2.9
// (22809 is 2.28.9), major*1000 + minor*100 + patch before (2804 is 2.8.4).
std::string FormatNcclVersion(int code);

// The entry points of one loaded NCCL.
struct Nccl {
  std::string path;      // the candidate it was loaded from, as given ("libnccl.so.2", a path)
  std::string file;      // the file the dynamic linker mapped for it (dlinfo); path if unknown
  int version_code = 0;  // ncclGetVersion, e.g. 22809
  int major = 0, minor = 0, patch = 0;

  ncclResult_t (*ncclGetVersion)(int*) = nullptr;
  ncclResult_t (*ncclGetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*ncclCommInitRank)(ncclComm_t*, int nranks, ncclUniqueId, int rank) = nullptr;
  ncclResult_t (*ncclCommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*ncclCommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*ncclCommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*ncclSend)(const void*, size_t count, ncclDataType_t, int peer, ncclComm_t,
                           cudaStream_t) = nullptr;
  ncclResult_t (*ncclRecv)(void*, size_t count, ncclDataType_t, int peer, ncclComm_t,
                           cudaStream_t) = nullptr;
  ncclResult_t (*ncclGroupStart)() = nullptr;
  ncclResult_t (*ncclGroupEnd)() = nullptr;
  const char* (*ncclGetErrorString)(ncclResult_t) = nullptr;
  // Optional (NULL when the library lacks it; every NCCL >= 2.14 has it): a communicator made
  // with a config, so non-blocking (ncclInProgress, then ncclCommGetAsyncError until success).
  ncclResult_t (*ncclCommInitRankConfig)(ncclComm_t*, int nranks, ncclUniqueId, int rank,
                                         ncclConfig_t*) = nullptr;

  // "2.28.9".
  std::string version() const { return FormatNcclVersion(version_code); }
  // "unhandled system error (2)"; "NCCL error 2" when NCCL gives no string.
  std::string ErrorString(ncclResult_t r) const;
};

// Tries each candidate in order (dlopen RTLD_NOW | RTLD_LOCAL); the first that has every entry
// point of Nccl and is NCCL >= 2.18 is returned. A candidate that does not load, lacks a symbol
// or is too old is passed over; when none is usable: UNAVAILABLE listing every candidate with why
// ("<path>: <dlerror>", "<path>: lacks ncclCommGetAsyncError", "<path>: NCCL 2.17.1 is older
// than 2.18.0, the oldest kvbridge supports"). Nothing is cached: each success maps the library
// (dlopen counts references) and allocates a table, both kept until the module is unloaded or
// the process exits (for good once KeepNcclLoaded was called).
sdk::Result<const Nccl*> LoadNccl(const std::vector<std::string>& candidates);

// Where NCCL is looked for, in order:
//   1. $KVBRIDGE_NCCL_LIBRARY when set and not empty: only it.
//   2. PyPI's nvidia-nccl-cu* wheel: <dir>/nvidia/nccl/lib/libnccl.so.2 for each directory of
//      $PYTHONPATH, then under $VIRTUAL_ENV/lib/python*/site-packages when $VIRTUAL_ENV is set;
//      only files that exist.
//   3. "libnccl.so.2": the dynamic linker's search (a copy the process already has, e.g. one
//      torch loaded; LD_LIBRARY_PATH; the ldconfig cache).
//   4. /usr/local/cuda/lib64/libnccl.so.2 (the CUDA toolkit).
// Duplicates are dropped. Reads the environment on every call.
std::vector<std::string> DefaultNcclCandidates();

// LoadNccl(DefaultNcclCandidates()) the first time; the same answer (table or error) after.
sdk::Result<const Nccl*> LoadNcclOnce();
// Says that a transport runs on a table LoadNccl handed out. Until it is called, the tables and
// their libraries are released when this module is unloaded or the process exits (a plugin
// whose probe said UNAVAILABLE is unloaded by the host: it leaves no table behind and drops its
// reference to libnccl); after it, they stay for good, as a transport may still use them then.
void KeepNcclLoaded();

// Whether the loaded NCCL can run here: NCCL needs a GPU, so the CUDA driver ($KVBRIDGE_CUDA_DRIVER
// when set, else libcuda.so.1) is loaded and asked (cuInit(0), cuDeviceGetCount). OK only with
// NCCL and at least one device; otherwise UNAVAILABLE, e.g. "NCCL 2.28.9 from libnccl.so.2 is
// loaded but there is no CUDA driver (libcuda.so.1: <dlerror>)". nullptr: UNAVAILABLE "NCCL is
// not loaded". Nothing is cached (the driver, once loaded, stays mapped).
sdk::Status ProbeNccl(const Nccl* nccl);

namespace detail {

// The parts of LoadNccl and ProbeNccl that take their entry points from the caller, so tests can
// reach every branch without an old NCCL or a GPU.

// Binds every entry point of Nccl through `lookup` (dlsym on the library in LoadNccl), calls
// ncclGetVersion and checks it. The table (path and file left empty), or UNAVAILABLE with the
// reason alone: "lacks <symbol>" (the first missing, in the order of Nccl's fields),
// "ncclGetVersion failed: <n>", "NCCL <v> is older than 2.18.0, the oldest kvbridge supports".
sdk::Result<std::unique_ptr<Nccl>> Bind(const std::function<void*(const char*)>& lookup);

// The CUDA driver as ProbeNccl uses it.
struct CudaProbe {
  std::string path;                                    // the library, for messages
  int (*cuInit)(unsigned) = nullptr;                   // CUresult cuInit(unsigned int Flags)
  int (*cuDeviceGetCount)(int*) = nullptr;             // CUresult cuDeviceGetCount(int* count)
  int (*cuGetErrorName)(int, const char**) = nullptr;  // optional
};

// ProbeNccl once the driver is loaded: cuInit(0) failing, cuDeviceGetCount failing or counting
// no device are UNAVAILABLE naming NCCL, the driver and the error.
sdk::Status ProbeWith(const Nccl& nccl, const CudaProbe& cuda);

}  // namespace detail
}  // namespace kvbridge::nccl
