#include "dram_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <sstream>

#include "host_config.h"

#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif
#ifndef MAP_HUGE_2MB
#define MAP_HUGE_2MB (21 << MAP_HUGE_SHIFT)
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and we touch pages
#endif

namespace kvbridge::dram {
namespace {

constexpr const char* kName = "dram";

using plugin::ParseUnsigned;

void Log(const kvb_host_services_t* host, int32_t level, const std::string& msg) {
  plugin::HostLog(host, level, kName, msg);
}

bool ReadKey(const kvb_host_services_t* host, const char* key, std::string* value, bool* set,
             std::string* err) {
  return plugin::ReadConfigKey(host, kName, key, value, set, err);
}

std::string Bytes(uint64_t n) {
  std::ostringstream os;
  if (n >= (1ull << 30) && n % (1ull << 30) == 0) {
    os << (n >> 30) << " GiB";
  } else if (n >= (1ull << 20) && n % (1ull << 20) == 0) {
    os << (n >> 20) << " MiB";
  } else {
    os << n << " bytes";
  }
  return os.str();
}

// First line of a small sysfs/proc file, or "" when it cannot be read.
std::string ReadLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ("always [madvise] never").
std::string ThpMode() {
  const std::string line = ReadLine("/sys/kernel/mm/transparent_hugepage/enabled");
  const size_t open = line.find('['), close = line.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "unknown";
  return line.substr(open + 1, close - open - 1);
}

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return uint64_t{1} << 47;  // the user address space
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

// Normal pages, aligned to 2 MiB so transparent huge pages can back the whole segment: map
// 2 MiB more than needed and trim both ends.
void* MapAligned(uint64_t bytes) {
  const uint64_t padded = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePageBytes - 1) & ~(uintptr_t{kHugePageBytes} - 1);
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t tail = start + padded - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  return reinterpret_cast<void*>(aligned);
}

// Makes every page of the segment resident now, so first transfers do not page-fault. Leaves
// the bytes as they are (a dram.file segment holds the file's).
bool Prefault(void* base, uint64_t bytes, bool huge, std::string* err) {
  if (madvise(base, bytes, MADV_POPULATE_WRITE) == 0) return true;
  if (errno != EINVAL) {  // EINVAL: a kernel older than 5.14; touch the pages instead
    *err = std::string("dram: cannot prefault the segment: ") + std::strerror(errno);
    return false;
  }
  const long page = huge ? static_cast<long>(kHugePageBytes) : sysconf(_SC_PAGESIZE);
  auto* p = static_cast<volatile uint8_t*>(base);
  for (uint64_t off = 0; off < bytes; off += static_cast<uint64_t>(page > 0 ? page : 4096)) {
    p[off] = p[off];  // a write fault, keeping the byte
  }
  return true;
}

}  // namespace

bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err) {
  std::string v;
  bool set = false;

  if (!ReadKey(host, "dram.hugepages", &v, &set, err)) return false;
  if (set) {
    if (v == "auto") {
      out->huge_pages = Config::HugePages::kAuto;
    } else if (v == "on") {
      out->huge_pages = Config::HugePages::kOn;
    } else if (v == "off") {
      out->huge_pages = Config::HugePages::kOff;
    } else {
      *err = "dram: dram.hugepages must be auto, on or off, not '" + v + "'";
      return false;
    }
  }

  if (!ReadKey(host, "dram.alignment", &v, &set, err)) return false;
  if (set) {
    uint64_t a = 0;
    if (!ParseUnsigned(v, &a) || a == 0 || (a & (a - 1)) != 0 || a > kHugePageBytes) {
      *err = "dram: dram.alignment must be a power of two from 1 to 2097152, not '" + v + "'";
      return false;
    }
    out->alignment = a;
  }

  if (!ReadKey(host, "dram.prefault", &v, &set, err)) return false;
  if (set) {
    if (v != "0" && v != "1") {
      *err = "dram: dram.prefault must be 0 or 1, not '" + v + "'";
      return false;
    }
    out->prefault = v == "1";
  }

  if (!ReadKey(host, "dram.file", &v, &set, err)) return false;
  if (set) out->file = v;
  if (!ReadKey(host, "dram.file_offset", &v, &set, err)) return false;
  if (set) {
    uint64_t off = 0;
    const long page = sysconf(_SC_PAGESIZE);
    if (!ParseUnsigned(v, &off) || (page > 0 && off % static_cast<uint64_t>(page) != 0)) {
      *err = "dram: dram.file_offset must be a multiple of the page size (" + std::to_string(page) +
             " bytes), not '" + v + "'";
      return false;
    }
    if (out->file.empty()) {
      *err = "dram: dram.file_offset is set but dram.file is not";
      return false;
    }
    out->file_offset = off;
  }
  return true;
}

namespace {

// The segment as `bytes` of config.file from config.file_offset, mapped shared. The file must
// exist and hold them (it is not grown: it may be another process's memory).
kvb_status_t MapFile(const kvb_host_services_t* host, const Config& config, uint64_t bytes,
                     void** base, std::string* err) {
  const std::string where = "dram: dram.file '" + config.file + "'";
  struct stat st {};
  if (stat(config.file.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    *err = where + " is not a regular file";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  const int fd = open(config.file.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *err = where + " cannot be opened: " + std::strerror(errno);
    return errno == ENOENT ? KVB_ERR_NOT_FOUND : KVB_ERR_INVALID_ARGUMENT;
  }
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    *err = where + " is not a regular file";
    close(fd);
    return KVB_ERR_INVALID_ARGUMENT;
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (config.file_offset > size || bytes > size - config.file_offset) {
    *err = where + " has " + std::to_string(size) + " bytes; a " + Bytes(bytes) +
           " segment at offset " + std::to_string(config.file_offset) + " needs " +
           std::to_string(config.file_offset + bytes);
    close(fd);
    return KVB_ERR_INVALID_ARGUMENT;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                 static_cast<off_t>(config.file_offset));
  const int e = errno;
  close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) {
    *err = where + ": mmap of " + Bytes(bytes) + " failed: " + std::strerror(e);
    return KVB_ERR_NO_SPACE;
  }
  *base = p;
  Log(host, KVB_LOG_INFO,
      Bytes(bytes) + " segment on file " + config.file + " at offset " +
          std::to_string(config.file_offset) + " (shared mapping)");
  return KVB_OK;
}

}  // namespace

kvb_status_t DramPool::Create(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                              std::unique_ptr<DramPool>* out, std::string* err) {
  if (params == nullptr || out == nullptr ||
      params->struct_size <
          offsetof(kvb_storage_params_t, capacity_bytes) + sizeof(params->capacity_bytes)) {
    *err = "dram: create needs params (with capacity_bytes) and out";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  const uint64_t requested = params->capacity_bytes;
  if (requested == 0) {
    *err = "dram: capacity_bytes must be > 0";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  const uint64_t physical = PhysicalMemoryBytes();
  if (requested > physical) {
    *err = "dram: capacity_bytes " + std::to_string(requested) +
           " is more than this machine's physical memory (" + std::to_string(physical) + " bytes)";
    return KVB_ERR_INVALID_ARGUMENT;
  }
  Config config;
  if (!LoadConfig(host, &config, err)) return KVB_ERR_INVALID_ARGUMENT;
  const uint64_t bytes = !config.file.empty()
                             ? requested
                             : (requested + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;

  void* base = nullptr;
  bool huge = false;
  std::string why;  // how we came to the pages we got, for the log line
  if (!config.file.empty()) {
    if (config.huge_pages == Config::HugePages::kOn) {
      *err = "dram: dram.hugepages=on cannot be honoured for a segment on dram.file '" +
             config.file + "' (the file's own pages back it)";
      return KVB_ERR_INVALID_ARGUMENT;
    }
    if (kvb_status_t st = MapFile(host, config, bytes, &base, err); st != KVB_OK) return st;
  } else if (config.huge_pages == Config::HugePages::kOff) {
    why = "dram.hugepages=off";
  } else {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_HUGE_2MB, -1, 0);
    if (base != MAP_FAILED) {
      huge = true;
    } else {
      base = nullptr;
      const int e = errno;
      std::string free_pages = ReadLine("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages");
      if (free_pages.empty()) free_pages = "unknown";
      why = std::string("MAP_HUGETLB failed: ") + std::strerror(e) + " (" +
            std::to_string(bytes / kHugePageBytes) + " huge pages of 2 MiB needed, " + free_pages +
            " free; reserve them with vm.nr_hugepages)";
      if (config.huge_pages == Config::HugePages::kOn) {
        *err =
            "dram: dram.hugepages=on but no huge pages for a " + Bytes(bytes) + " segment: " + why;
        return KVB_ERR_UNAVAILABLE;
      }
    }
  }

  if (!config.file.empty()) {
    // MapFile mapped and logged it.
  } else if (huge) {
    Log(host, KVB_LOG_INFO, Bytes(bytes) + " segment on 2 MiB huge pages (MAP_HUGETLB)");
  } else {
    base = MapAligned(bytes);
    if (base == nullptr) {
      *err = "dram: cannot map a " + Bytes(bytes) + " segment: " + std::strerror(errno);
      return KVB_ERR_NO_SPACE;
    }
    std::string thp;
    if (madvise(base, bytes, MADV_HUGEPAGE) == 0) {
      thp = "transparent huge pages requested (THP mode: " + ThpMode() + ")";
    } else {
      thp = std::string("transparent huge pages unavailable (MADV_HUGEPAGE: ") +
            std::strerror(errno) + ")";
    }
    Log(host, KVB_LOG_INFO,
        Bytes(bytes) + " segment on normal pages, 2 MiB-aligned, " + thp + "; " + why);
  }

  if (config.prefault) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!Prefault(base, bytes, huge, err)) {
      munmap(base, bytes);
      return KVB_ERR_NO_SPACE;
    }
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    Log(host, KVB_LOG_INFO, "prefaulted " + Bytes(bytes) + " in " + std::to_string(ms) + " ms");
  }

  try {
    out->reset(new DramPool(base, bytes, huge, config.alignment));
  } catch (...) {
    munmap(base, bytes);
    throw;  // the glue turns it into KVB_ERR_INTERNAL
  }
  return KVB_OK;
}

DramPool::DramPool(void* base, uint64_t bytes, bool huge_pages, uint64_t alignment)
    : base_(base), bytes_(bytes), huge_pages_(huge_pages), allocator_(bytes, alignment) {}

DramPool::~DramPool() { munmap(base_, bytes_); }

kvb_status_t DramPool::Alloc(uint64_t length, uint64_t* offset) {
  if (length == 0 || offset == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  std::lock_guard<std::mutex> lk(mu_);
  const auto at = allocator_.Allocate(length);
  if (!at) return KVB_ERR_NO_SPACE;
  *offset = *at;
  return KVB_OK;
}

kvb_status_t DramPool::Free(uint64_t offset) {
  std::lock_guard<std::mutex> lk(mu_);
  return allocator_.Free(offset) != 0 ? KVB_OK : KVB_ERR_NOT_FOUND;
}

kvb_status_t DramPool::Usage(kvb_storage_usage_t* out) {
  // Fills ABI 1.0's fields; fields a newer host appended stay as the host set them.
  if (out == nullptr ||
      out->struct_size < offsetof(kvb_storage_usage_t, object_count) + sizeof(out->object_count)) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lk(mu_);
  out->capacity_bytes = allocator_.capacity();
  out->used_bytes = allocator_.used_bytes();
  out->object_count = allocator_.allocation_count();
  return KVB_OK;
}

}  // namespace kvbridge::dram
