// kvbridge::nccl's loader and probe (plugins/transport_nccl/nccl_loader.h) against the libraries
// this machine has: missing paths and a library without NCCL's symbols are UNAVAILABLE naming
// each path and why; the CUDA toolkit's NCCL (/usr/local/cuda/lib64/libnccl.so.2) and PyPI's
// (nvidia-nccl-cu* wheel) load when present; KVBRIDGE_NCCL_LIBRARY overrides the search; the
// probe names NCCL's version and the missing CUDA driver, or is OK where there is a GPU.
// Branches no machine here can reach (an old NCCL, cuInit failing, no device) go through
// detail::Bind and detail::ProbeWith with fake entry points.
// LoadNcclOnce caches per process, so its tests run in a child (this binary again, with
// --gtest_filter and the environment set): the NcclChild.* tests skip unless run that way.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nccl_loader.h"
#include "tests/common/run_self.h"

namespace kvbridge::nccl {
namespace {

namespace fs = std::filesystem;

constexpr const char* kToolkitNccl = "/usr/local/cuda/lib64/libnccl.so.2";
constexpr const char* kNoSymbols = "/lib/x86_64-linux-gnu/libz.so.1";
constexpr const char* kChildMarker = "KVBTEST_NCCL_CHILD";

bool Exists(const std::string& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Sets (or, with nullptr, unsets) an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// What dlopen says about `path` (the loader must pass it on verbatim).
std::string DlopenError(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib != nullptr) {
    dlclose(lib);
    return "";
  }
  const char* e = dlerror();
  return e != nullptr ? e : "";
}

int RunSelf(const std::string& test, const std::vector<std::pair<std::string, const char*>>& env,
            std::string* out) {
  return kvbridge::testing::RunSelf(kChildMarker, test, env, out);
}

bool IsChild() { return kvbridge::testing::IsSelfChild(kChildMarker); }

void ExpectEveryEntryPoint(const Nccl& n) {
  EXPECT_NE(n.ncclGetVersion, nullptr);
  EXPECT_NE(n.ncclGetUniqueId, nullptr);
  EXPECT_NE(n.ncclCommInitRank, nullptr);
  EXPECT_NE(n.ncclCommAbort, nullptr);
  EXPECT_NE(n.ncclCommDestroy, nullptr);
  EXPECT_NE(n.ncclCommGetAsyncError, nullptr);
  EXPECT_NE(n.ncclSend, nullptr);
  EXPECT_NE(n.ncclRecv, nullptr);
  EXPECT_NE(n.ncclGroupStart, nullptr);
  EXPECT_NE(n.ncclGroupEnd, nullptr);
  EXPECT_NE(n.ncclGetErrorString, nullptr);
}

// Loads `path`, checks the table, and returns it (nullptr after a failure).
const Nccl* ExpectLoads(const std::string& path) {
  auto n = LoadNccl({path});
  EXPECT_TRUE(n.ok()) << n.status().message();
  if (!n.ok()) return nullptr;
  const Nccl& nccl = **n;
  ExpectEveryEntryPoint(nccl);
  EXPECT_EQ(nccl.path, path);
  EXPECT_FALSE(nccl.file.empty());
  EXPECT_GE(nccl.version_code, kMinNcclVersionCode);
  EXPECT_EQ(nccl.major * 10000 + nccl.minor * 100 + nccl.patch, nccl.version_code);
  EXPECT_EQ(nccl.version(), std::to_string(nccl.major) + "." + std::to_string(nccl.minor) + "." +
                                std::to_string(nccl.patch));
  int code = 0;
  EXPECT_EQ(nccl.ncclGetVersion(&code), ncclSuccess);
  EXPECT_EQ(code, nccl.version_code);
  EXPECT_FALSE(nccl.ErrorString(ncclSuccess).empty());
  std::cout << "[ INFO     ] NCCL " << nccl.version() << " from " << nccl.path << " (" << nccl.file
            << ")\n";
  return &nccl;
}

// The wheel's libnccl.so.2: $KVBTEST_NCCL_WHEEL, the one CMake found next to Python, else the
// first wheel copy DefaultNcclCandidates sees ($PYTHONPATH, $VIRTUAL_ENV). "" when none.
std::string WheelNccl() {
  if (const char* p = std::getenv("KVBTEST_NCCL_WHEEL"); p != nullptr && p[0] != '\0') return p;
#ifdef KVBTEST_NCCL_WHEEL_PATH
  if (Exists(KVBTEST_NCCL_WHEEL_PATH)) return KVBTEST_NCCL_WHEEL_PATH;
#endif
  for (const std::string& c : DefaultNcclCandidates()) {
    if (Contains(c, "nvidia/nccl/lib/")) return c;
  }
  return "";
}

// A loaded NCCL for the probe: the toolkit's when present, else a table that only names itself
// (the probe reads nothing else).
const Nccl& SomeNccl() {
  static const Nccl* const n = [] {
    if (Exists(kToolkitNccl)) {
      auto r = LoadNccl({kToolkitNccl});
      if (r.ok()) return *r;
    }
    auto* fake = new Nccl;
    fake->path = "fake-libnccl.so.2";
    fake->version_code = 22809;
    return static_cast<const Nccl*>(fake);
  }();
  return *n;
}

// ---- LoadNccl -------------------------------------------------------------------------------

TEST(LoadNccl, MissingPathIsUnavailableNamingItAndItsDlerror) {
  const std::string path = "/nonexistent/kvbtest/libnccl.so.2";
  const std::string why = DlopenError(path);
  ASSERT_FALSE(why.empty());
  auto n = LoadNccl({path});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), KVB_ERR_UNAVAILABLE);
  EXPECT_TRUE(Contains(n.status().message(), path + ": " + why)) << n.status().message();
  EXPECT_TRUE(Contains(n.status().message(), "2.18")) << n.status().message();
}

TEST(LoadNccl, EveryMissingCandidateIsListedInOrder) {
  const std::vector<std::string> paths = {"/nonexistent/a/libnccl.so.2", "libkvbtest_no_nccl.so.2",
                                          "/nonexistent/c/libnccl.so.2"};
  auto n = LoadNccl(paths);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), KVB_ERR_UNAVAILABLE);
  const std::string msg = n.status().message();
  size_t at = 0;
  for (const std::string& p : paths) {
    const size_t found = msg.find(p + ": " + DlopenError(p), at);
    EXPECT_NE(found, std::string::npos) << p << " (after offset " << at << ") in: " << msg;
    if (found != std::string::npos) at = found + p.size();
  }
}

TEST(LoadNccl, NoCandidatesIsUnavailable) {
  auto n = LoadNccl({});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), KVB_ERR_UNAVAILABLE);
  EXPECT_TRUE(Contains(n.status().message(), "no candidates")) << n.status().message();
}

TEST(LoadNccl, LibraryWithoutNcclSymbolsNamesItAndTheFirstMissing) {
  if (!Exists(kNoSymbols)) GTEST_SKIP() << kNoSymbols << " is absent on this machine";
  auto n = LoadNccl({kNoSymbols});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), KVB_ERR_UNAVAILABLE);
  EXPECT_TRUE(Contains(n.status().message(), std::string(kNoSymbols) + ": lacks ncclGetVersion"))
      << n.status().message();
}

TEST(LoadNccl, ToolkitNcclLoads) {
  if (!Exists(kToolkitNccl)) GTEST_SKIP() << kToolkitNccl << " is absent on this machine";
  ExpectLoads(kToolkitNccl);
}

TEST(LoadNccl, WheelNcclLoads) {
  const std::string wheel = WheelNccl();
  if (wheel.empty()) {
    GTEST_SKIP() << "no nvidia-nccl-cu* wheel found (set KVBTEST_NCCL_WHEEL, PYTHONPATH or "
                    "VIRTUAL_ENV)";
  }
  ExpectLoads(wheel);
}

TEST(LoadNccl, UnusableCandidatesArePassedOverForTheFirstUsable) {
  if (!Exists(kToolkitNccl)) GTEST_SKIP() << kToolkitNccl << " is absent on this machine";
  std::vector<std::string> paths = {"/nonexistent/libnccl.so.2"};
  if (Exists(kNoSymbols)) paths.push_back(kNoSymbols);
  paths.push_back(kToolkitNccl);
  paths.push_back("/nonexistent/after/libnccl.so.2");
  auto n = LoadNccl(paths);
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ((*n)->path, kToolkitNccl);
}

// ---- DefaultNcclCandidates ------------------------------------------------------------------

TEST(DefaultNcclCandidates, EnvironmentVariableIsTheOnlyCandidate) {
  ScopedEnv lib("KVBRIDGE_NCCL_LIBRARY", "/nonexistent/chosen/libnccl.so.2");
  EXPECT_EQ(DefaultNcclCandidates(), std::vector<std::string>{"/nonexistent/chosen/libnccl.so.2"});
  // Even where another NCCL would load, the chosen one is all that is tried.
  auto n = LoadNccl(DefaultNcclCandidates());
  ASSERT_FALSE(n.ok());
  EXPECT_TRUE(Contains(n.status().message(), "/nonexistent/chosen/libnccl.so.2: "))
      << n.status().message();
  EXPECT_FALSE(Contains(n.status().message(), kToolkitNccl)) << n.status().message();
}

TEST(DefaultNcclCandidates, EnvironmentVariablePicksTheToolkitCopy) {
  if (!Exists(kToolkitNccl)) GTEST_SKIP() << kToolkitNccl << " is absent on this machine";
  ScopedEnv lib("KVBRIDGE_NCCL_LIBRARY", kToolkitNccl);
  auto n = LoadNccl(DefaultNcclCandidates());
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ((*n)->path, kToolkitNccl);
}

TEST(DefaultNcclCandidates, WithoutPythonTheLinkerSearchThenTheToolkit) {
  ScopedEnv lib("KVBRIDGE_NCCL_LIBRARY", nullptr);
  ScopedEnv pp("PYTHONPATH", nullptr);
  ScopedEnv venv("VIRTUAL_ENV", nullptr);
  EXPECT_EQ(DefaultNcclCandidates(),
            (std::vector<std::string>{"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"}));
  ScopedEnv empty("KVBRIDGE_NCCL_LIBRARY", "");  // empty is unset
  EXPECT_EQ(DefaultNcclCandidates().size(), 2u);
}

TEST(DefaultNcclCandidates, WheelCopiesFromPythonPathThenVirtualEnvFirst) {
  const fs::path root = fs::temp_directory_path() / ("kvbtest_nccl_" + std::to_string(getpid()));
  fs::remove_all(root);
  const fs::path pp1 = root / "pp1", pp2 = root / "pp2", venv = root / "venv";
  const fs::path wheel1 = pp2 / "nvidia/nccl/lib/libnccl.so.2";
  const fs::path wheel2 = venv / "lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2";
  fs::create_directories(pp1);  // no wheel there: not a candidate
  fs::create_directories(wheel1.parent_path());
  fs::create_directories(wheel2.parent_path());
  fs::create_directories(venv / "lib/python3.10/site-packages");  // no wheel for this one
  std::ofstream(wheel1).put('x');
  std::ofstream(wheel2).put('x');

  ScopedEnv lib("KVBRIDGE_NCCL_LIBRARY", nullptr);
  const std::string pythonpath = pp1.string() + "::" + pp2.string() + ":/nonexistent/kvbtest";
  ScopedEnv pp("PYTHONPATH", pythonpath.c_str());
  ScopedEnv ve("VIRTUAL_ENV", venv.string().c_str());
  EXPECT_EQ(DefaultNcclCandidates(),
            (std::vector<std::string>{wheel1.string(), wheel2.string(), "libnccl.so.2",
                                      "/usr/local/cuda/lib64/libnccl.so.2"}));
  // The same directory twice is tried once.
  const std::string twice = pp2.string() + ":" + pp2.string();
  ScopedEnv pp_twice("PYTHONPATH", twice.c_str());
  ScopedEnv no_venv("VIRTUAL_ENV", nullptr);
  EXPECT_EQ(DefaultNcclCandidates(),
            (std::vector<std::string>{wheel1.string(), "libnccl.so.2",
                                      "/usr/local/cuda/lib64/libnccl.so.2"}));
  fs::remove_all(root);
}

// ---- LoadNcclOnce (in a child: it caches per process) ---------------------------------------

TEST(LoadNcclOnce, CachesTheFirstAnswerEvenAnError) {
  std::string out;
  const int rc = RunSelf("NcclChild.FirstAnswerIsKept",
                         {{"KVBRIDGE_NCCL_LIBRARY", "/nonexistent/once/libnccl.so.2"}}, &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(Contains(out, "[  PASSED  ] 1 test")) << out;
}

TEST(LoadNcclOnce, LoadsTheChosenNcclOnceForEveryThread) {
  if (!Exists(kToolkitNccl)) GTEST_SKIP() << kToolkitNccl << " is absent on this machine";
  std::string out;
  const int rc =
      RunSelf("NcclChild.SameTableForEveryThread", {{"KVBRIDGE_NCCL_LIBRARY", kToolkitNccl}}, &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(Contains(out, "[  PASSED  ] 1 test")) << out;
}

TEST(NcclChild, FirstAnswerIsKept) {
  if (!IsChild()) GTEST_SKIP() << "runs as a child of LoadNcclOnce.CachesTheFirstAnswerEvenAnError";
  auto first = LoadNcclOnce();
  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.status().code(), KVB_ERR_UNAVAILABLE);
  EXPECT_TRUE(Contains(first.status().message(), "/nonexistent/once/libnccl.so.2: "))
      << first.status().message();
  // A usable library named now changes nothing: the first answer stays.
  setenv("KVBRIDGE_NCCL_LIBRARY", kToolkitNccl, 1);
  auto again = LoadNcclOnce();
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().message(), first.status().message());
}

TEST(NcclChild, SameTableForEveryThread) {
  if (!IsChild()) GTEST_SKIP() << "runs as a child of LoadNcclOnce.LoadsTheChosenNccl...";
  std::vector<const Nccl*> seen(8, nullptr);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < seen.size(); ++i) {
    threads.emplace_back([&seen, i] {
      auto n = LoadNcclOnce();
      if (n.ok()) seen[i] = *n;
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_NE(seen[0], nullptr);
  for (const Nccl* n : seen) EXPECT_EQ(n, seen[0]);
  EXPECT_EQ(seen[0]->path, kToolkitNccl);
  ExpectEveryEntryPoint(*seen[0]);
}

// ---- detail::Bind: versions and symbols no library here has ---------------------------------

int g_fake_version = 0;
int g_fake_version_result = ncclSuccess;
int FakeGetVersion(int* v) {
  *v = g_fake_version;
  return g_fake_version_result;
}
int FakeResult() { return ncclSuccess; }
const char* FakeErrorString(int) { return "fake error"; }

// Every symbol resolves (to something callable for the two Bind calls) except `missing`.
std::function<void*(const char*)> FakeLookup(std::string missing = "") {
  return [missing](const char* name) -> void* {
    if (missing == name) return nullptr;
    if (std::strcmp(name, "ncclGetVersion") == 0) return reinterpret_cast<void*>(&FakeGetVersion);
    if (std::strcmp(name, "ncclGetErrorString") == 0) {
      return reinterpret_cast<void*>(&FakeErrorString);
    }
    return reinterpret_cast<void*>(&FakeResult);
  };
}

TEST(NcclBind, FormatsBothVersionSchemes) {
  EXPECT_EQ(FormatNcclVersion(22809), "2.28.9");
  EXPECT_EQ(FormatNcclVersion(21800), "2.18.0");
  EXPECT_EQ(FormatNcclVersion(21703), "2.17.3");
  EXPECT_EQ(FormatNcclVersion(2804), "2.8.4");  // before 2.9: major*1000 + minor*100 + patch
  EXPECT_EQ(FormatNcclVersion(30102), "3.1.2");
}

TEST(NcclBind, AcceptsTheOldestSupportedAndNewer) {
  for (const int v : {21800, 22809, 30000}) {
    g_fake_version = v;
    g_fake_version_result = ncclSuccess;
    auto n = detail::Bind(FakeLookup());
    ASSERT_TRUE(n.ok()) << v << ": " << n.status().message();
    EXPECT_EQ((*n)->version_code, v);
    EXPECT_EQ((*n)->version(), FormatNcclVersion(v));
    EXPECT_EQ((*n)->major * 10000 + (*n)->minor * 100 + (*n)->patch, v);
    ExpectEveryEntryPoint(**n);
  }
}

TEST(NcclBind, RefusesOlderThan218NamingBothVersions) {
  for (const int v : {21703, 2804}) {
    g_fake_version = v;
    g_fake_version_result = ncclSuccess;
    auto n = detail::Bind(FakeLookup());
    ASSERT_FALSE(n.ok()) << v;
    EXPECT_EQ(n.status().code(), KVB_ERR_UNAVAILABLE);
    EXPECT_EQ(n.status().message(), "NCCL " + FormatNcclVersion(v) +
                                        " is older than 2.18.0, the oldest kvbridge supports");
  }
}

TEST(NcclBind, GetVersionFailingIsNamed) {
  g_fake_version = 22809;
  g_fake_version_result = 3;  // ncclInternalError
  auto n = detail::Bind(FakeLookup());
  g_fake_version_result = ncclSuccess;
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(n.status().message(), "ncclGetVersion failed: fake error (3)");
}

TEST(NcclBind, EachMissingSymbolIsNamed) {
  g_fake_version = 22809;
  for (const char* sym : {"ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommAbort",
                          "ncclCommDestroy", "ncclCommGetAsyncError", "ncclSend", "ncclRecv",
                          "ncclGroupStart", "ncclGroupEnd", "ncclGetErrorString"}) {
    auto n = detail::Bind(FakeLookup(sym));
    ASSERT_FALSE(n.ok()) << sym;
    EXPECT_EQ(n.status().code(), KVB_ERR_UNAVAILABLE);
    EXPECT_EQ(n.status().message(), std::string("lacks ") + sym);
  }
}

// ---- ProbeNccl -------------------------------------------------------------------------------

TEST(ProbeNccl, NotLoadedIsUnavailable) {
  const sdk::Status st = ProbeNccl(nullptr);
  EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(st.message(), "NCCL is not loaded");
}

TEST(ProbeNccl, MissingDriverNamesNcclAndTheDriver) {
  const Nccl& n = SomeNccl();
  ScopedEnv driver("KVBRIDGE_CUDA_DRIVER", "/nonexistent/libcuda.so.1");
  const sdk::Status st = ProbeNccl(&n);
  EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(st.message(),
            "NCCL " + n.version() + " from " + n.path +
                " is loaded but there is no CUDA driver (/nonexistent/libcuda.so.1: " +
                DlopenError("/nonexistent/libcuda.so.1") + ")");
}

TEST(ProbeNccl, DriverWithoutCuInitIsNamed) {
  if (!Exists(kNoSymbols)) GTEST_SKIP() << kNoSymbols << " is absent on this machine";
  const Nccl& n = SomeNccl();
  ScopedEnv driver("KVBRIDGE_CUDA_DRIVER", kNoSymbols);
  const sdk::Status st = ProbeNccl(&n);
  EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(st.message(), "NCCL " + n.version() + " from " + n.path +
                              " is loaded but the CUDA driver " + kNoSymbols + " lacks cuInit");
}

// On this machine (no libcuda.so.1) the default driver is missing; where it loads, the test asks
// the driver itself whether there is a GPU and expects OK exactly then.
TEST(ProbeNccl, DefaultDriverIsMissingHereOrThereIsAGpu) {
  const Nccl& n = SomeNccl();
  ScopedEnv driver("KVBRIDGE_CUDA_DRIVER", nullptr);
  const sdk::Status st = ProbeNccl(&n);
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
    EXPECT_EQ(st.message(), "NCCL " + n.version() + " from " + n.path +
                                " is loaded but there is no CUDA driver (libcuda.so.1: " +
                                (why ? why : "") + ")");
    std::cout << "[ INFO     ] " << st.message() << "\n";
    return;
  }
  auto init = reinterpret_cast<int (*)(unsigned)>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<int (*)(int*)>(dlsym(lib, "cuDeviceGetCount"));
  ASSERT_NE(init, nullptr);
  ASSERT_NE(count, nullptr);
  int devices = 0;
  const bool gpu = init(0) == 0 && count(&devices) == 0 && devices > 0;
  std::cout << "[ INFO     ] libcuda.so.1 loads, " << devices
            << " device(s): " << (st.ok() ? "OK" : st.message()) << "\n";
  if (gpu) {
    EXPECT_TRUE(st.ok()) << st.message();
  } else {
    EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
    EXPECT_TRUE(Contains(st.message(), "NCCL " + n.version() + " from " + n.path)) << st.message();
  }
}

int g_init_result = 0;
int g_count_result = 0;
int g_count = 0;
int FakeCuInit(unsigned flags) { return flags == 0 ? g_init_result : 1; }
int FakeCuDeviceGetCount(int* n) {
  *n = g_count;
  return g_count_result;
}
int FakeCuGetErrorName(int r, const char** name) {
  *name = r == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
  return 0;
}

detail::CudaProbe FakeCuda(int init, int count_result, int count, bool names = true) {
  g_init_result = init;
  g_count_result = count_result;
  g_count = count;
  detail::CudaProbe c;
  c.path = "fake-libcuda.so.1";
  c.cuInit = &FakeCuInit;
  c.cuDeviceGetCount = &FakeCuDeviceGetCount;
  if (names) c.cuGetErrorName = &FakeCuGetErrorName;
  return c;
}

TEST(ProbeNcclWith, CuInitFailingIsNamed) {
  const Nccl& n = SomeNccl();
  const std::string head = "NCCL " + n.version() + " from " + n.path +
                           " is loaded but the CUDA driver fake-libcuda.so.1";
  sdk::Status st = detail::ProbeWith(n, FakeCuda(100, 0, 1));
  EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(st.message(), head + " cannot start: cuInit(0) failed: CUDA_ERROR_NO_DEVICE (100)");
  st = detail::ProbeWith(n, FakeCuda(999, 0, 1, /*names=*/false));
  EXPECT_EQ(st.message(), head + " cannot start: cuInit(0) failed: CUDA error 999");
}

TEST(ProbeNcclWith, DeviceCountFailingOrZeroIsNamed) {
  const Nccl& n = SomeNccl();
  const std::string head = "NCCL " + n.version() + " from " + n.path +
                           " is loaded but the CUDA driver fake-libcuda.so.1";
  sdk::Status st = detail::ProbeWith(n, FakeCuda(0, 999, 0));
  EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(st.message(),
            head + " cannot count GPUs: cuDeviceGetCount failed: CUDA_ERROR_UNKNOWN (999)");
  st = detail::ProbeWith(n, FakeCuda(0, 0, 0));
  EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(st.message(), head + " sees no GPU (cuDeviceGetCount: 0)");
}

TEST(ProbeNcclWith, OkWithAtLeastOneDevice) {
  const Nccl& n = SomeNccl();
  EXPECT_TRUE(detail::ProbeWith(n, FakeCuda(0, 0, 1)).ok());
  EXPECT_TRUE(detail::ProbeWith(n, FakeCuda(0, 0, 8)).ok());
  detail::CudaProbe missing = FakeCuda(0, 0, 1);
  missing.cuDeviceGetCount = nullptr;
  const sdk::Status st = detail::ProbeWith(n, missing);
  EXPECT_EQ(st.code(), KVB_ERR_UNAVAILABLE);
  EXPECT_TRUE(Contains(st.message(), "fake-libcuda.so.1 lacks cuDeviceGetCount")) << st.message();
}

}  // namespace
}  // namespace kvbridge::nccl
