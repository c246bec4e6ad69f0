// The ssd storage plugin beyond the shared storage suite: what it promises about files on disk.
// Restart recovery, kill -9 in the middle of writes, damaged bucket files, a full file system (a
// tiny tmpfs), a read-only one, a file system without O_DIRECT (ramfs), eviction of whole
// buckets, the bound on bytes in flight, io_uring and its pread/pwrite fallback (io_uring
// blocked by seccomp in a child process). Every test loads the real plugin through the real
// loader and works on real files in a directory of its own.
//
// Tests that mount file systems need root (CAP_SYS_ADMIN); without it they skip and say so.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/host_services.h"
#include "core/plugin_host.h"

namespace kvbridge::core {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMiB = 1u << 20;
constexpr uint64_t kKiB = 1u << 10;

// The build tree's plugins, scanned once for the whole binary.
PluginHost& Plugins() {
  static const std::shared_ptr<PluginHost> host = PluginHost::Acquire({KVBRIDGE_PLUGIN_BUILD_DIR});
  return *host;
}

kvb_status_t Code(const Status& st) { return static_cast<kvb_status_t>(st.code()); }

// Host services whose config is a map and whose log lines are kept for the test to read.
class Host {
 public:
  explicit Host(std::map<std::string, std::string> config)
      : inner_(std::move(config), std::nullopt, [this](int32_t, const char*, const char* msg) {
          std::lock_guard<std::mutex> lk(mu_);
          lines_.push_back(msg);
        }) {}
  const kvb_host_services_t* table() const { return inner_.table(); }
  std::vector<std::string> lines() const {
    std::lock_guard<std::mutex> lk(mu_);
    return lines_;
  }
  std::string Find(const std::string& needle) const {
    for (const auto& l : lines()) {
      if (l.find(needle) != std::string::npos) return l;
    }
    return "";
  }
  std::string All() const {
    std::string out;
    for (const auto& l : lines()) out += l + "\n";
    return out;
  }

 private:
  HostServices inner_;
  mutable std::mutex mu_;
  std::vector<std::string> lines_;
};

// What on_evict reported.
struct Evictions {
  std::mutex mu;
  std::vector<std::string> keys;
  void Add(std::string_view key) {
    std::lock_guard<std::mutex> lk(mu);
    keys.emplace_back(key);
  }
  std::vector<std::string> Take() {
    std::lock_guard<std::mutex> lk(mu);
    return std::move(keys);
  }
};

struct Listed {
  uint64_t length = 0;
  std::string meta;
  bool operator==(const Listed&) const = default;
};

// Deterministic object bytes for a key.
std::vector<uint8_t> Content(const std::string& key, uint64_t length) {
  std::vector<uint8_t> v(length);
  uint64_t x = std::hash<std::string>()(key) | 1;
  for (uint64_t i = 0; i < length; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<uint8_t>(x);
  }
  return v;
}

// One plugin instance on one directory, destroyed with the object. Owns its host.
class Store {
 public:
  struct Options {
    std::map<std::string, std::string> config;
    uint64_t capacity = 64 * kMiB;
    Evictions* evictions = nullptr;  // null: no on_evict (the plugin must not evict)
    bool abi_1_0_params = false;     // params as a 1.0 host passes them
  };

  // dir "" passes no path (NULL) to the plugin.
  static std::unique_ptr<Store> Open(const std::string& dir, Options o, kvb_status_t* st,
                                     std::string* err) {
    auto host = std::make_unique<Host>(o.config);
    StorageConfig config;
    config.node_id = "ssd-test";
    config.capacity_bytes = o.capacity;
    config.path = dir;
    config.services = host->table();
    if (o.abi_1_0_params) {
      config.params_struct_size = offsetof(kvb_storage_params_t, path) + sizeof(const char*);
    }
    if (Evictions* ev = o.evictions; ev != nullptr) {
      config.on_evict = [ev](std::string_view key) { ev->Add(key); };
    }
    Result<std::unique_ptr<StorageInstance>> s = Plugins().CreateStorage("ssd", config);
    *st = Code(s.status());
    *err = s.status().message();
    if (!s.ok()) {
      last_failed_host_ = std::move(host);
      return nullptr;
    }
    return std::unique_ptr<Store>(new Store(std::move(host), std::move(s).value()));
  }

  // Destroys the instance but keeps the host, so the closing log line can be read.
  void Close() { s_.reset(); }
  Host& host() { return *host_; }

  kvb_status_t Put(const std::string& key, const std::vector<uint8_t>& v,
                   const std::string& meta = "") {
    kvb_iovec_t iov{const_cast<uint8_t*>(v.data()), v.size()};
    return Code(s_->PutMeta(key, {&iov, 1}, meta));
  }
  // Puts Content(key, length).
  kvb_status_t PutContent(const std::string& key, uint64_t length, const std::string& meta = "") {
    return Put(key, Content(key, length), meta);
  }
  kvb_status_t Get(const std::string& key, std::vector<uint8_t>* out) {
    uint64_t length = 0;
    kvb_iovec_t none{nullptr, 0};
    kvb_status_t st = Code(s_->Get(key, {&none, 1}, &length));
    if (st != KVB_ERR_INVALID_ARGUMENT || length == 0) {
      out->clear();
      return st;
    }
    out->assign(length, 0);
    kvb_iovec_t iov{out->data(), out->size()};
    return Code(s_->Get(key, {&iov, 1}, &length));
  }
  // OK when the object is there and holds Content(key, its length).
  kvb_status_t Check(const std::string& key) {
    std::vector<uint8_t> got;
    const kvb_status_t st = Get(key, &got);
    if (st != KVB_OK) return st;
    return got == Content(key, got.size()) ? KVB_OK : KVB_ERR_INTERNAL;
  }
  kvb_status_t Remove(const std::string& key) { return Code(s_->Remove(key)); }
  std::map<std::string, Listed> List() {
    std::map<std::string, Listed> out;
    EXPECT_TRUE(
        s_->ForEachMeta([&out](std::string_view key, uint64_t length, std::string_view meta) {
            const std::string k(key);
            EXPECT_EQ(out.count(k), 0u) << "listed twice";
            out[k] = {length, std::string(meta)};
          }).ok());
    return out;
  }
  StorageUsage Usage() {
    Result<StorageUsage> u = s_->Usage();
    EXPECT_TRUE(u.ok()) << u.status().ToString();
    return u.ok() ? u.value() : StorageUsage{};
  }

  static std::unique_ptr<Host> last_failed_host_;

 private:
  Store(std::unique_ptr<Host> host, std::unique_ptr<StorageInstance> s)
      : host_(std::move(host)), s_(std::move(s)) {}
  std::unique_ptr<Host> host_;  // outlives s_ (the plugin logs through it until destroyed)
  std::unique_ptr<StorageInstance> s_;
};
std::unique_ptr<Host> Store::last_failed_host_;

std::vector<std::string> BucketFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename();
    if (name.starts_with("bucket-") && name.ends_with(".kvb")) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A record as the format in plugins/storage_ssd/README.md lays it out, found by walking a
// bucket file's 4 KiB blocks for the record magic.
struct RecordOnDisk {
  uint64_t offset, data_offset, data_len;
  std::string key;
};
std::vector<RecordOnDisk> RecordsIn(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<RecordOnDisk> out;
  for (uint64_t off = 0; off + 64 <= bytes.size(); off += 4096) {
    if (std::memcmp(bytes.data() + off, "KVBO", 4) != 0) continue;
    uint32_t key_len, meta_len;
    uint64_t data_len;
    std::memcpy(&key_len, bytes.data() + off + 8, 4);
    std::memcpy(&meta_len, bytes.data() + off + 12, 4);
    std::memcpy(&data_len, bytes.data() + off + 16, 8);
    if (key_len > 4096 || off + 64 + key_len > bytes.size()) continue;
    out.push_back({off, off + 64 + key_len + meta_len, data_len,
                   std::string(bytes.data() + off + 64, key_len)});
  }
  return out;
}

void FlipByte(const std::string& path, uint64_t offset) {
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  uint8_t b = 0;
  ASSERT_EQ(pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x5a;
  ASSERT_EQ(pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  fsync(fd);
  close(fd);
}

// A file system mounted for one test, detached when it ends.
class ScopedMount {
 public:
  ScopedMount(const std::string& type, const std::string& dir, unsigned long flags,
              const std::string& data)
      : dir_(dir) {
    fs::create_directories(dir);
    if (mount(type.c_str(), dir.c_str(), type.c_str(), flags, data.c_str()) == 0) {
      mounted_ = true;
    } else {
      why_ = "mount -t " + type + " " + dir + ": " + std::strerror(errno) +
             " (needs root / CAP_SYS_ADMIN)";
    }
  }
  ~ScopedMount() {
    if (mounted_) umount2(dir_.c_str(), MNT_DETACH);
  }
  bool ok() const { return mounted_; }
  const std::string& why() const { return why_; }

 private:
  std::string dir_;
  bool mounted_ = false;
  std::string why_;
};

class SsdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    ASSERT_NE(Plugins().registry().Find(KVB_PLUGIN_STORAGE, "ssd", &why), nullptr)
        << "libkvb_storage_ssd.so did not load from " << KVBRIDGE_PLUGIN_BUILD_DIR << ": " << why;
    std::string tmpl = (fs::temp_directory_path() / "kvb_ssd_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
    dir_ = root_ + "/store";
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  std::unique_ptr<Store> MustOpen(Store::Options o, const std::string& dir = "") {
    kvb_status_t st;
    std::string err;
    auto s = Store::Open(dir.empty() ? dir_ : dir, std::move(o), &st, &err);
    EXPECT_EQ(st, KVB_OK) << err;
    return s;
  }

  std::string root_, dir_;
};

// --- restart ----------------------------------------------------------------------------

TEST_F(SsdTest, RestartKeepsObjectsMetadataAndRemoves) {
  std::map<std::string, Listed> expect;
  uint64_t used_before = 0;
  {
    auto s = MustOpen({.config = {{"ssd.bucket_bytes", std::to_string(2 * kMiB)}}});
    ASSERT_NE(s, nullptr);
    std::mt19937_64 rng(1);
    for (int i = 0; i < 40; ++i) {
      std::string key = "page/" + std::to_string(i);
      if (i % 7 == 0) key += std::string("\0\xff", 2);  // keys are bytes
      const uint64_t len = i == 0 ? 0 : i == 1 ? 1 : rng() % (i % 5 == 0 ? 3 * kMiB : 200 * kKiB);
      const std::string meta =
          i % 3 == 0 ? "" : std::string(1 + i * 6, static_cast<char>('a' + i % 26));
      ASSERT_EQ(s->PutContent(key, len, meta), KVB_OK) << key;
      expect[key] = {len, meta};
    }
    for (const std::string key : {"page/3", "page/10", "page/39"}) {
      ASSERT_EQ(s->Remove(key), KVB_OK);
      expect.erase(key);
    }
    EXPECT_EQ(s->List(), expect);
    used_before = s->Usage().used_bytes;
  }
  EXPECT_GE(BucketFiles(dir_).size(), 4u) << "expected several 2 MiB buckets";

  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("restart " + std::to_string(round + 1));
    auto s = MustOpen({.config = {{"ssd.bucket_bytes", std::to_string(2 * kMiB)}}});
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->List(), expect);
    for (const auto& [key, l] : expect) EXPECT_EQ(s->Check(key), KVB_OK) << key;
    const auto u = s->Usage();
    EXPECT_EQ(u.object_count, expect.size());
    EXPECT_EQ(u.used_bytes, used_before) << "the same records take the same space";
    EXPECT_EQ(s->host().Find("scanned"), "") << "sealed buckets are read from their index\n"
                                             << s->host().All();
    std::vector<uint8_t> none;
    EXPECT_EQ(s->Get("page/10", &none), KVB_ERR_NOT_FOUND) << "a remove survives restarts";
    if (round == 1) {
      EXPECT_EQ(s->Get("page/4", &none), KVB_ERR_NOT_FOUND);
    }
    if (round == 0) {
      // New objects after a restart go to new buckets, and a key can be put again.
      ASSERT_EQ(s->PutContent("page/3", 5000, "again"), KVB_OK);
      expect["page/3"] = {5000, "again"};
      ASSERT_EQ(s->Remove("page/4"), KVB_OK);
      expect.erase("page/4");
      used_before = s->Usage().used_bytes;
    }
  }
}

TEST_F(SsdTest, KeysAndMetadataAreValidated) {
  auto s = MustOpen({});
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->PutContent(std::string(4096, 'k'), 10), KVB_OK) << "4096-byte keys are allowed";
  EXPECT_EQ(s->PutContent(std::string(4097, 'k'), 10), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(s->PutContent("", 10), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(s->PutContent("m", 10, std::string(257, 'm')), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(s->Usage().object_count, 1u);
  std::vector<uint8_t> got;
  EXPECT_EQ(s->Get(std::string(4097, 'k'), &got), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(s->Remove(""), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(s->Check(std::string(4096, 'k')), KVB_OK);
}

// --- crashes ------------------------------------------------------------------------------

// A child process writes objects from four threads and reports each put that returned; it is
// killed with SIGKILL at some moment of its writing. Every acknowledged object must come back,
// and every object that comes back must hold exactly its bytes. The restart must also have
// scanned a bucket that was being written (no index yet); a kill that lands exactly between a
// seal and the next record leaves none, so the writer is run again (new keys, same store) until
// one kill lands inside a bucket.
TEST_F(SsdTest, KillDashNineMidWriteLosesNothingAcknowledgedAndReturnsNothingTorn) {
  const Store::Options options{.config = {{"ssd.bucket_bytes", std::to_string(4 * kMiB)}},
                               .capacity = uint64_t{4} << 30};
  std::set<std::string> acked;
  bool scanned_unsealed = false;
  std::string last_log;
  for (int attempt = 0; attempt < 4 && !scanned_unsealed; ++attempt) {
    int acks[2];
    ASSERT_EQ(pipe(acks), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(acks[0]);
      kvb_status_t st;
      std::string err;
      auto s = Store::Open(dir_, options, &st, &err);
      if (s == nullptr) _exit(3);
      std::vector<std::thread> threads;
      for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
          std::mt19937_64 rng(t);
          for (int i = 0;; ++i) {
            char key[32];
            std::snprintf(key, sizeof(key), "a%d-t%d-%06d", attempt, t, i);
            const uint64_t len = 1 + rng() % (i % 4 == 0 ? 2 * kMiB : 96 * kKiB);
            if (s->PutContent(key, len, std::to_string(len)) != KVB_OK) _exit(4);
            (void)!write(acks[1], key, sizeof(key));  // < PIPE_BUF: one atomic write
          }
        });
      }
      for (auto& th : threads) th.join();
      _exit(0);
    }
    close(acks[1]);
    const size_t before = acked.size();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    char key[32];
    while (acked.size() < before + 300 && std::chrono::steady_clock::now() < deadline) {
      if (read(acks[0], key, sizeof(key)) != sizeof(key)) break;
      acked.insert(key);
    }
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the writer stopped on its own, status " << status;
    while (read(acks[0], key, sizeof(key)) == sizeof(key)) acked.insert(key);  // sent before death
    close(acks[0]);
    ASSERT_GE(acked.size() - before, 50u) << "the writer hardly wrote anything";

    auto s = MustOpen(options);
    ASSERT_NE(s, nullptr);
    const auto listed = s->List();
    for (const std::string& k : acked)
      EXPECT_EQ(listed.count(k), 1u) << "acknowledged " << k << " lost (attempt " << attempt << ")";
    for (const auto& [k, l] : listed) {
      EXPECT_EQ(l.meta, std::to_string(l.length)) << k;
      EXPECT_EQ(s->Check(k), KVB_OK) << k << " came back with other bytes";
    }
    EXPECT_EQ(s->Usage().object_count, listed.size());
    scanned_unsealed = s->host().Find("not sealed") != "";
    last_log = s->host().All();
  }
  EXPECT_TRUE(scanned_unsealed) << "no kill left a bucket being written (no index) in 4 tries:\n"
                                << last_log;
}

// Damage inside a bucket that was being written (no index yet): the scan at restart checks every
// record and drops the damaged ones; the rest are served.
TEST_F(SsdTest, DamagedRecordsOfAnUnsealedBucketAreDroppedAtRestart) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    kvb_status_t st;
    std::string err;
    auto s = Store::Open(dir_, {}, &st, &err);
    if (s == nullptr) _exit(3);
    for (int i = 0; i < 12; ++i) {
      if (s->PutContent("obj-" + std::to_string(i), 50 * kKiB + i) != KVB_OK) _exit(4);
    }
    _exit(0);  // no destroy: the bucket keeps no index, as after a crash
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  const auto files = BucketFiles(dir_);
  ASSERT_EQ(files.size(), 1u);
  const auto records = RecordsIn(files[0]);
  ASSERT_EQ(records.size(), 12u);
  // A flipped data byte, a zeroed 4 KiB block in the middle of a record (a torn write), and a
  // damaged header.
  FlipByte(files[0], records[2].data_offset + 1000);
  {
    const int fd = open(files[0].c_str(), O_RDWR);
    std::vector<uint8_t> zeros(4096, 0);
    ASSERT_EQ(
        pwrite(fd, zeros.data(), zeros.size(), static_cast<off_t>(records[5].offset + 4 * 4096)),
        4096);
    close(fd);
  }
  FlipByte(files[0], records[9].offset + 20);
  const std::set<std::string> damaged = {records[2].key, records[5].key, records[9].key};

  auto s = MustOpen({});
  ASSERT_NE(s, nullptr);
  const auto listed = s->List();
  EXPECT_EQ(listed.size(), 9u);
  for (const auto& r : records) {
    std::vector<uint8_t> got;
    if (damaged.count(r.key) != 0) {
      EXPECT_EQ(s->Get(r.key, &got), KVB_ERR_NOT_FOUND) << r.key;
    } else {
      EXPECT_EQ(s->Check(r.key), KVB_OK) << r.key;
    }
  }
  const std::string line = s->host().Find("damaged records dropped");
  EXPECT_NE(line.find(files[0]), std::string::npos) << s->host().All();
  EXPECT_NE(line.find("2 damaged records dropped"), std::string::npos)
      << "two bodies failed their checksum (the bad header is skipped as garbage):\n"
      << line;
  s.reset();
  s = MustOpen({});
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->List(), listed) << "the second restart reads the index written by the first";
}

// --- damaged sealed buckets ---------------------------------------------------------------

class SsdSealedTest : public SsdTest {
 protected:
  void SetUp() override {
    SsdTest::SetUp();
    auto s = MustOpen({.config = {{"ssd.bucket_bytes", std::to_string(kMiB)}}});
    ASSERT_NE(s, nullptr);
    for (int i = 0; i < 16; ++i) {
      keys_.push_back("k" + std::to_string(i));
      ASSERT_EQ(s->PutContent(keys_.back(), 200 * kKiB, "m" + std::to_string(i)), KVB_OK);
    }
    s.reset();  // seals every bucket
    files_ = BucketFiles(dir_);
    ASSERT_GE(files_.size(), 3u);
  }
  std::vector<std::string> keys_;
  std::vector<std::string> files_;
};

TEST_F(SsdSealedTest, ADamagedObjectIsAnIoErrorThenGoneAndTheOthersAreServed) {
  const auto records = RecordsIn(files_[1]);
  ASSERT_FALSE(records.empty());
  const std::string victim = records[0].key;
  FlipByte(files_[1], records[0].data_offset + 123456);

  auto s = MustOpen({});
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->List().count(victim), 1u) << "the index lists it until a get finds the damage";
  std::vector<uint8_t> got;
  EXPECT_EQ(s->Get(victim, &got), KVB_ERR_IO);
  const std::string line = s->host().Find("dropped: checksum mismatch");
  EXPECT_NE(line.find(files_[1]), std::string::npos) << s->host().All();
  EXPECT_NE(line.find(victim), std::string::npos) << line;
  EXPECT_EQ(s->Get(victim, &got), KVB_ERR_NOT_FOUND) << "dropped, never returned";
  EXPECT_EQ(s->List().count(victim), 0u);
  for (const std::string& k : keys_) {
    if (k != victim) {
      EXPECT_EQ(s->Check(k), KVB_OK) << k;
    }
  }
  EXPECT_EQ(s->Usage().object_count, keys_.size() - 1);
  s.reset();
  s = MustOpen({});
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->List().count(victim), 0u) << "the drop survives a restart";
  EXPECT_EQ(s->List().size(), keys_.size() - 1);
}

TEST_F(SsdSealedTest, ADamagedIndexFallsBackToScanningTheRecords) {
  const uint64_t size = fs::file_size(files_[0]);
  FlipByte(files_[0], size - 100);  // inside the index (footer) at the end of the file
  auto s = MustOpen({});
  ASSERT_NE(s, nullptr);
  const std::string line = s->host().Find("bucket index checksum mismatch; scanned the records");
  EXPECT_NE(line.find(files_[0]), std::string::npos) << s->host().All();
  EXPECT_EQ(s->List().size(), keys_.size());
  for (const std::string& k : keys_) EXPECT_EQ(s->Check(k), KVB_OK) << k;
}

TEST_F(SsdSealedTest, GarbageAndTruncatedBucketFilesDoNotStopTheOthers) {
  // Bucket 2 loses its tail (its index and its last records); a garbage file takes a bucket's
  // name; a file that is no bucket is ignored.
  const auto records2 = RecordsIn(files_[1]);
  ASSERT_GE(records2.size(), 2u);
  fs::resize_file(files_[1], records2[1].offset + 5000);
  {
    std::ofstream junk(dir_ + "/bucket-00000000000000ff.kvb", std::ios::binary);
    std::mt19937 rng(3);
    for (int i = 0; i < 300000; ++i) junk.put(static_cast<char>(rng()));
  }
  std::ofstream(dir_ + "/notes.txt") << "not a bucket";
  auto s = MustOpen({});
  ASSERT_NE(s, nullptr);
  for (const std::string& k : keys_) {
    std::vector<uint8_t> got;
    const bool lost = std::any_of(records2.begin() + 1, records2.end(),
                                  [&](const RecordOnDisk& r) { return r.key == k; });
    if (lost) {
      EXPECT_EQ(s->Get(k, &got), KVB_ERR_NOT_FOUND) << k;
    } else {
      EXPECT_EQ(s->Check(k), KVB_OK) << k;
    }
  }
  EXPECT_NE(s->host().Find("bucket-00000000000000ff.kvb"), "") << s->host().All();
  EXPECT_NE(s->host().Find(files_[1]), "") << s->host().All();
  EXPECT_TRUE(fs::exists(dir_ + "/notes.txt"));
  // New objects get a bucket id above every file present, the garbage one included.
  ASSERT_EQ(s->PutContent("after", 1000), KVB_OK);
  EXPECT_EQ(s->Check("after"), KVB_OK);
  EXPECT_TRUE(fs::exists(dir_ + "/bucket-0000000000000100.kvb"));
}

// --- file system faults -----------------------------------------------------------------

TEST_F(SsdTest, FullFileSystemIsNoSpaceLeavesNothingPartialAndKeepsServing) {
  ScopedMount tmpfs("tmpfs", root_ + "/small", 0, "size=8m");
  if (!tmpfs.ok()) GTEST_SKIP() << tmpfs.why();
  const std::string dir = root_ + "/small/store";
  Store::Options o{.config = {{"ssd.bucket_bytes", std::to_string(kMiB)}}, .capacity = 64 * kMiB};
  auto s = MustOpen(o, dir);
  ASSERT_NE(s, nullptr);
  EXPECT_NE(s->host().Find("more than the file system can hold"), "") << s->host().All();
  std::vector<std::string> stored;
  kvb_status_t st = KVB_OK;
  std::string failed;
  for (int i = 0; i < 100; ++i) {
    const std::string key = "fill-" + std::to_string(i);
    st = s->PutContent(key, 300 * kKiB, "m");
    if (st != KVB_OK) {
      failed = key;
      break;
    }
    stored.push_back(key);
  }
  ASSERT_EQ(st, KVB_ERR_NO_SPACE) << "an 8 MiB file system must fill up";
  ASSERT_GE(stored.size(), 10u);
  const std::string line = s->host().Find("No space left on device");
  EXPECT_NE(line.find(dir), std::string::npos) << s->host().All();
  std::vector<uint8_t> got;
  EXPECT_EQ(s->Get(failed, &got), KVB_ERR_NOT_FOUND) << "a failed put left something visible";
  EXPECT_EQ(s->List().size(), stored.size());
  EXPECT_EQ(s->Usage().object_count, stored.size());
  for (const std::string& k : stored) EXPECT_EQ(s->Check(k), KVB_OK) << k;
  // Removing frees blocks right away (holes), so puts work again.
  ASSERT_EQ(s->Remove(stored[0]), KVB_OK) << "remove works on a full file system";
  ASSERT_EQ(s->Remove(stored[1]), KVB_OK);
  EXPECT_EQ(s->PutContent(failed, 300 * kKiB, "m"), KVB_OK);
  stored.erase(stored.begin(), stored.begin() + 2);
  stored.push_back(failed);
  s.reset();
  s = MustOpen(o, dir);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->List().size(), stored.size());
  for (const std::string& k : stored) EXPECT_EQ(s->Check(k), KVB_OK) << k;
}

TEST_F(SsdTest, ReadOnlyDirectoryIsUnavailableNamingIt) {
  const std::string mnt = root_ + "/ro";
  ScopedMount tmpfs("tmpfs", mnt, 0, "size=4m");
  if (!tmpfs.ok()) GTEST_SKIP() << tmpfs.why();
  const std::string dir = mnt + "/store";
  {
    auto s = MustOpen({}, dir);
    ASSERT_NE(s, nullptr);
    ASSERT_EQ(s->PutContent("k", 1000), KVB_OK);
  }
  ASSERT_EQ(mount("tmpfs", mnt.c_str(), "tmpfs", MS_REMOUNT | MS_RDONLY, "size=4m"), 0)
      << std::strerror(errno);
  kvb_status_t st;
  std::string err;
  EXPECT_EQ(Store::Open(dir, {}, &st, &err), nullptr);
  EXPECT_EQ(st, KVB_ERR_UNAVAILABLE);
  EXPECT_NE(err.find(dir), std::string::npos) << err;
  EXPECT_NE(err.find("Read-only file system"), std::string::npos) << err;
  // A directory that does not exist yet on a read-only file system cannot be created either.
  EXPECT_EQ(Store::Open(mnt + "/other", {}, &st, &err), nullptr);
  EXPECT_EQ(st, KVB_ERR_UNAVAILABLE);
  EXPECT_NE(err.find(mnt + "/other"), std::string::npos) << err;
  EXPECT_NE(err.find("Read-only file system"), std::string::npos) << err;
}

TEST_F(SsdTest, BufferedIoWhereTheFileSystemHasNoODirect) {
  ScopedMount ramfs("ramfs", root_ + "/ram", 0, "");
  if (!ramfs.ok()) GTEST_SKIP() << ramfs.why();
  const std::string dir = root_ + "/ram/store";
  {
    auto s = MustOpen({}, dir);
    ASSERT_NE(s, nullptr);
    EXPECT_NE(s->host().Find("does not support O_DIRECT"), "") << s->host().All();
    for (int i = 0; i < 5; ++i)
      ASSERT_EQ(s->PutContent("r" + std::to_string(i), 70000 * i), KVB_OK);
  }
  auto s = MustOpen({}, dir);
  ASSERT_NE(s, nullptr);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s->Check("r" + std::to_string(i)), KVB_OK);
}

TEST_F(SsdTest, DirectoryProblemsAreClearErrors) {
  kvb_status_t st;
  std::string err;
  // Missing, parent present: created.
  auto s = Store::Open(dir_, {}, &st, &err);
  ASSERT_EQ(st, KVB_OK) << err;
  EXPECT_NE(s->host().Find("created directory " + dir_), "") << s->host().All();
  // In use by another instance.
  EXPECT_EQ(Store::Open(dir_, {}, &st, &err), nullptr);
  EXPECT_EQ(st, KVB_ERR_UNAVAILABLE);
  EXPECT_NE(err.find("in use by another"), std::string::npos) << err;
  s.reset();
  EXPECT_NE(Store::Open(dir_, {}, &st, &err), nullptr) << "the lock goes with the instance";
  // Missing parent: not created.
  const std::string deep = root_ + "/no/such/dir";
  EXPECT_EQ(Store::Open(deep, {}, &st, &err), nullptr);
  EXPECT_EQ(st, KVB_ERR_UNAVAILABLE);
  EXPECT_NE(err.find(deep), std::string::npos) << err;
  EXPECT_NE(err.find("neither does its parent"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(root_ + "/no"));
  // A file, not a directory.
  std::ofstream(root_ + "/file") << "x";
  EXPECT_EQ(Store::Open(root_ + "/file", {}, &st, &err), nullptr);
  EXPECT_EQ(st, KVB_ERR_INVALID_ARGUMENT);
  EXPECT_NE(err.find("not a directory"), std::string::npos) << err;
  // No path at all.
  EXPECT_EQ(Store::Open("", {}, &st, &err), nullptr);
  EXPECT_EQ(st, KVB_ERR_INVALID_ARGUMENT);
  EXPECT_NE(err.find("params.path"), std::string::npos) << err;
}

TEST_F(SsdTest, MalformedConfigIsInvalidArgumentNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"ssd.bucket_bytes", "0"},
      {"ssd.bucket_bytes", "1048575"},
      {"ssd.bucket_bytes", "2147483648"},
      {"ssd.bucket_bytes", "1048577"},
      {"ssd.bucket_bytes", "64M"},
      {"ssd.io", "fast"},
      {"ssd.io", ""},
      {"ssd.max_inflight_bytes", "4096"},
      {"ssd.max_inflight_bytes", "-1"},
      {"ssd.max_inflight_bytes", std::string(100, '9')}};
  for (const auto& [key, value] : bad) {
    SCOPED_TRACE(key + "=" + value);
    kvb_status_t st;
    std::string err;
    EXPECT_EQ(Store::Open(dir_, {.config = {{key, value}}}, &st, &err), nullptr);
    EXPECT_EQ(st, KVB_ERR_INVALID_ARGUMENT);
    EXPECT_NE(err.find(key), std::string::npos) << err;
  }
}

// --- capacity and eviction ----------------------------------------------------------------

// 1 MiB buckets of four 250 KiB objects each (records of 252 KiB, and a 4 KiB index).
constexpr int kPerBucket = 4;
std::string EvKey(int i) { return "ev-" + std::to_string(i); }

TEST_F(SsdTest, EvictsWholeBucketsLeastRecentlyReadFirstAndReportsEachObject) {
  Evictions ev;
  Store::Options o{.config = {{"ssd.bucket_bytes", std::to_string(kMiB)}},
                   .capacity = 8 * kMiB,
                   .evictions = &ev};
  auto s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  int n = 0;
  for (; n < 6 * kPerBucket; ++n) ASSERT_EQ(s->PutContent(EvKey(n), 250 * kKiB), KVB_OK);
  ASSERT_TRUE(ev.Take().empty()) << "no eviction before the capacity is reached";
  std::vector<std::vector<std::string>> batches;
  for (; n < 16 * kPerBucket; ++n) {
    if (n % kPerBucket == 0) {  // bucket 0 is read all along: the others are colder
      for (int i = 0; i < kPerBucket; ++i) ASSERT_EQ(s->Check(EvKey(i)), KVB_OK);
    }
    ASSERT_EQ(s->PutContent(EvKey(n), 250 * kKiB), KVB_OK) << n;
    EXPECT_LE(s->Usage().used_bytes, 8 * kMiB);
    auto keys = ev.Take();
    if (!keys.empty()) batches.push_back(keys);
  }
  ASSERT_GE(batches.size(), 3u);
  std::set<std::string> evicted;
  for (const auto& batch : batches) {
    for (const auto& k : batch) EXPECT_TRUE(evicted.insert(k).second) << k << " reported twice";
  }
  // Whole buckets: objects leave in their put groups of four, never one alone.
  std::set<int> groups;
  for (const auto& k : evicted) groups.insert(std::stoi(k.substr(3)) / kPerBucket);
  for (int g : groups) {
    for (int i = 0; i < kPerBucket; ++i) {
      EXPECT_EQ(evicted.count(EvKey(g * kPerBucket + i)), 1u) << "bucket " << g << " split";
    }
  }
  // Oldest first, except that the bucket read above is spared for longer.
  EXPECT_EQ(std::stoi(batches[0][0].substr(3)) / kPerBucket, 1) << "bucket 1: oldest unread";
  EXPECT_EQ(groups.count(0), 0u) << "the recently read bucket went before unread ones";
  for (int i = 0; i < n; ++i) {
    std::vector<uint8_t> got;
    if (evicted.count(EvKey(i)) != 0) {
      EXPECT_EQ(s->Get(EvKey(i), &got), KVB_ERR_NOT_FOUND) << i;
    } else {
      EXPECT_EQ(s->Check(EvKey(i)), KVB_OK) << i;
    }
  }
  EXPECT_EQ(s->Usage().object_count, static_cast<uint64_t>(n) - evicted.size());
  EXPECT_EQ(BucketFiles(dir_).size(), n / kPerBucket - groups.size())
      << "evicted buckets' files are deleted";
  EXPECT_NE(s->host().Find("least recently read buckets"), "");

  // A put that even evicting every bucket could not fit is NO_SPACE and evicts nothing.
  const auto before = s->List();
  EXPECT_EQ(s->PutContent("huge", 8 * kMiB - 100 * kKiB), KVB_ERR_NO_SPACE);
  EXPECT_TRUE(ev.Take().empty());
  EXPECT_EQ(s->List(), before);
  s.reset();
  s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->List(), before) << "evicted objects stay gone after a restart";
}

TEST_F(SsdTest, WithoutOnEvictAFullStoreIsNoSpaceAndKeepsEverything) {
  for (const bool abi_1_0 : {false, true}) {
    SCOPED_TRACE(abi_1_0 ? "ABI 1.0 params" : "on_evict NULL");
    const std::string dir = dir_ + (abi_1_0 ? "-1.0" : "-null");
    auto s = MustOpen({.config = {{"ssd.bucket_bytes", std::to_string(kMiB)}},
                       .capacity = 4 * kMiB,
                       .abi_1_0_params = abi_1_0},
                      dir);
    ASSERT_NE(s, nullptr);
    int stored = 0;
    kvb_status_t st = KVB_OK;
    for (; stored < 40; ++stored) {
      st = s->PutContent(EvKey(stored), 250 * kKiB);
      if (st != KVB_OK) break;
    }
    EXPECT_EQ(st, KVB_ERR_NO_SPACE);
    EXPECT_GE(stored, 12);
    EXPECT_EQ(s->List().size(), static_cast<size_t>(stored));
    for (int i = 0; i < stored; ++i) EXPECT_EQ(s->Check(EvKey(i)), KVB_OK) << i;
    EXPECT_LE(s->Usage().used_bytes, 4 * kMiB);
  }
}

// --- I/O ----------------------------------------------------------------------------------

// Reads "in flight at most X of Y bytes, N waits" from the closing log line.
bool InflightStats(const Host& host, uint64_t* peak, uint64_t* bound, uint64_t* waits) {
  const std::string line = host.Find("in flight at most");
  const size_t at = line.find("in flight at most");
  return at != std::string::npos &&
         std::sscanf(line.c_str() + at,
                     "in flight at most %" SCNu64 " of %" SCNu64 " bytes, %" SCNu64, peak, bound,
                     waits) == 3;
}

TEST_F(SsdTest, BytesInFlightStayWithinTheConfiguredBound) {
  for (const std::string io : {"uring", "sync"}) {
    SCOPED_TRACE("ssd.io=" + io);
    const std::string dir = dir_ + "-" + io;
    auto s = MustOpen(
        {.config = {{"ssd.io", io}, {"ssd.max_inflight_bytes", std::to_string(kMiB)}}}, dir);
    ASSERT_NE(s, nullptr);
    std::atomic<int> errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 3; ++i) {
          const std::string key = "t" + std::to_string(t) + "-" + std::to_string(i);
          // One object in three is larger than the whole bound: it streams through it.
          if (s->PutContent(key, i == 2 ? 3 * kMiB + 5 : 512 * kKiB) != KVB_OK) ++errors;
          if (s->Check(key) != KVB_OK) ++errors;
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(errors.load(), 0);
    s->Close();
    uint64_t peak = 0, bound = 0, waits = 0;
    ASSERT_TRUE(InflightStats(s->host(), &peak, &bound, &waits)) << s->host().All();
    EXPECT_EQ(bound, kMiB);
    EXPECT_GT(peak, 0u);
    EXPECT_LE(peak, kMiB) << "more bytes in flight than ssd.max_inflight_bytes";
    EXPECT_GT(waits, 0u) << "eight writers on a 1 MiB bound never had to wait";
  }
}

TEST_F(SsdTest, UringAndSyncWriteTheSameFormat) {
  {
    auto s = MustOpen({.config = {{"ssd.io", "uring"}}});
    ASSERT_NE(s, nullptr);
    EXPECT_NE(s->host().Find("io_uring, registered"), "") << s->host().All();
    for (int i = 0; i < 6; ++i)
      ASSERT_EQ(s->PutContent("u" + std::to_string(i), 777777 * i), KVB_OK);
  }
  {
    auto s = MustOpen({.config = {{"ssd.io", "sync"}}});
    ASSERT_NE(s, nullptr);
    EXPECT_NE(s->host().Find("pread/pwrite (ssd.io=sync)"), "") << s->host().All();
    for (int i = 0; i < 6; ++i) EXPECT_EQ(s->Check("u" + std::to_string(i)), KVB_OK);
    for (int i = 0; i < 6; ++i)
      ASSERT_EQ(s->PutContent("s" + std::to_string(i), 555555 * i), KVB_OK);
  }
  auto s = MustOpen({.config = {{"ssd.io", "auto"}}});
  ASSERT_NE(s, nullptr);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(s->Check("s" + std::to_string(i)), KVB_OK);
}

// Runs `body` in a child process whose seccomp filter makes syscall `nr` fail with `err`; the
// child reports through its exit code (0: passed) and its lines on a pipe.
int RunWithSyscallBlocked(long nr, int err, const std::function<int(std::string*)>& body,
                          std::string* report) {
  int p[2];
  if (pipe(p) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1),
        BPF_STMT(BPF_RET | BPF_K,
                 SECCOMP_RET_ERRNO | (static_cast<uint32_t>(err) & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
    std::string out;
    int rc = 99;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
      out = std::string("seccomp: ") + std::strerror(errno);
      rc = 98;
    } else {
      rc = body(&out);
    }
    (void)!write(p[1], out.data(), out.size());
    _exit(rc);
  }
  close(p[1]);
  char buf[4096];
  ssize_t n;
  while ((n = read(p[0], buf, sizeof(buf))) > 0) report->append(buf, static_cast<size_t>(n));
  close(p[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

#if defined(__x86_64__)
TEST_F(SsdTest, AutoFallsBackToPreadPwriteWhenIoUringIsUnavailable) {
  std::string report;
  const int rc = RunWithSyscallBlocked(
      __NR_io_uring_setup, ENOSYS,
      [&](std::string* out) {
        kvb_status_t st;
        std::string err;
        // ssd.io=uring insists: create fails and says why.
        if (Store::Open(dir_ + "-uring", {.config = {{"ssd.io", "uring"}}}, &st, &err) != nullptr ||
            st != KVB_ERR_UNAVAILABLE || err.find("io_uring is unavailable") == std::string::npos) {
          *out = "ssd.io=uring: status " + std::to_string(st) + ": " + err;
          return 1;
        }
        auto s = Store::Open(dir_, {.config = {{"ssd.io", "auto"}}}, &st, &err);
        if (s == nullptr) {
          *out = "auto: " + err;
          return 2;
        }
        *out = s->host().Find("using pread/pwrite");
        if (out->find("io_uring_queue_init: Function not implemented") == std::string::npos)
          return 3;
        if (s->PutContent("a", 3 * kMiB) != KVB_OK || s->Check("a") != KVB_OK) return 4;
        return 0;
      },
      &report);
  if (rc == 98) GTEST_SKIP() << report;
  EXPECT_EQ(rc, 0) << report;
  EXPECT_NE(report.find("io_uring_queue_init: Function not implemented"), std::string::npos)
      << report;
  auto s = MustOpen({});
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->Check("a"), KVB_OK) << "what the fallback wrote reads back through io_uring";
}

TEST_F(SsdTest, UnregisteredBuffersWhenRegistrationFails) {
  std::string report;
  const int rc = RunWithSyscallBlocked(
      __NR_io_uring_register, EPERM,
      [&](std::string* out) {
        kvb_status_t st;
        std::string err;
        auto s = Store::Open(dir_, {.config = {{"ssd.io", "uring"}}}, &st, &err);
        if (s == nullptr) {
          *out = err;
          return 1;
        }
        *out = s->host().Find("io_uring_register_buffers failed") + "\n" +
               s->host().Find("io_uring, unregistered");
        if (out->find("Operation not permitted") == std::string::npos) return 2;
        if (out->find("io_uring, unregistered") == std::string::npos) return 3;
        std::vector<std::thread> threads;
        std::atomic<int> bad{0};
        for (int t = 0; t < 4; ++t) {
          threads.emplace_back([&, t] {
            const std::string k = "u" + std::to_string(t);
            if (s->PutContent(k, 2 * kMiB + 77) != KVB_OK || s->Check(k) != KVB_OK) ++bad;
          });
        }
        for (auto& th : threads) th.join();
        return bad.load() == 0 ? 0 : 4;
      },
      &report);
  if (rc == 98) GTEST_SKIP() << report;
  EXPECT_EQ(rc, 0) << report;
}
#endif

// --- concurrency --------------------------------------------------------------------------

// Puts, gets and removes from several threads on small buckets (so buckets fill, seal and empty
// while others use them), then a restart: what the threads believe is stored is exactly what
// comes back.
TEST_F(SsdTest, ConcurrentPutsGetsAndRemovesAgreeAfterARestart) {
  Store::Options o{.config = {{"ssd.bucket_bytes", std::to_string(kMiB)}},
                   .capacity = uint64_t{4} << 30};
  std::vector<std::set<std::string>> alive(6);
  {
    auto s = MustOpen(o);
    ASSERT_NE(s, nullptr);
    std::atomic<int> errors{0};
    std::vector<std::thread> threads;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1000);
    for (int t = 0; t < 6; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(t);
        auto& mine = alive[t];
        for (int i = 0; std::chrono::steady_clock::now() < until; ++i) {
          const std::string key = "c" + std::to_string(t) + "-" + std::to_string(i);
          if (s->PutContent(key, 1 + rng() % (150 * kKiB), key) != KVB_OK) ++errors;
          mine.insert(key);
          if (rng() % 3 == 0 && !mine.empty()) {
            auto victim = std::next(mine.begin(), static_cast<long>(rng() % mine.size()));
            if (s->Remove(*victim) != KVB_OK) ++errors;
            mine.erase(victim);
          }
          if (!mine.empty()) {
            auto probe = std::next(mine.begin(), static_cast<long>(rng() % mine.size()));
            if (s->Check(*probe) != KVB_OK) ++errors;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(errors.load(), 0);
  }
  std::set<std::string> expect;
  for (const auto& m : alive) expect.insert(m.begin(), m.end());
  auto s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  const auto listed = s->List();
  EXPECT_EQ(listed.size(), expect.size());
  for (const auto& k : expect) {
    ASSERT_EQ(listed.count(k), 1u) << k;
    EXPECT_EQ(listed.at(k).meta, k);
    EXPECT_EQ(s->Check(k), KVB_OK) << k;
  }
}

// Removes append to removed.log; once most of its entries belong to buckets that are gone, it
// is rewritten with only the live ones.
TEST_F(SsdTest, RemovalJournalIsCompactedAndStaysCorrect) {
  Store::Options o{.config = {{"ssd.bucket_bytes", std::to_string(kMiB)}}};
  const std::string journal = dir_ + "/removed.log";
  uint64_t peak_size = 0;
  {
    auto s = MustOpen(o);
    ASSERT_NE(s, nullptr);
    std::vector<std::thread> threads;
    std::atomic<int> errors{0};
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 320; ++i) {
          const std::string key = "j" + std::to_string(t) + "-" + std::to_string(i);
          if (s->PutContent(key, 100) != KVB_OK) ++errors;
          if (s->Remove(key) != KVB_OK) ++errors;
        }
        for (int i = 0; i < 5; ++i) {  // these stay
          if (s->PutContent("keep" + std::to_string(t) + "-" + std::to_string(i), 100) != KVB_OK) {
            ++errors;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    ASSERT_EQ(errors.load(), 0);
    peak_size = fs::file_size(journal);
  }
  auto s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  const auto listed = s->List();
  EXPECT_EQ(listed.size(), 8u * 5);
  for (const auto& [k, l] : listed) EXPECT_EQ(s->Check(k), KVB_OK) << k;
  // 2560 removes took 81920 bytes; compaction dropped the entries of the buckets that are gone.
  EXPECT_LT(fs::file_size(journal), 2560u * 32 / 2) << "peak " << peak_size;
  EXPECT_LT(peak_size, 2560u * 32) << "never compacted";
}

}  // namespace
}  // namespace kvbridge::core
