// kvb_bench_kernels: GB/s of the page-copy kernels per SGLang host layout, against plain
// copies of the same bytes measured in the same run.
//
// CPU: kvb_page_copy_cpu packing pages from an SGLang-style device pool (per-layer K/V
// buffers, here in host memory) into each host layout (and back, for page_first), against
// memcpy of the same number of bytes with the same threads, and a naive single-threaded
// per-row loop. GPU (when one is usable): kvb_page_copy_cuda between device buffers against
// cudaMemcpy device-to-device of the same bytes, and into pinned host memory against
// cudaMemcpy device-to-host. Progress goes to stderr; the last stdout line is one JSON object
// (docs/benchmarks.md). Its result is "benchmark": "kernels-c" (`benchmarks/run kernels-c`): the
// C API against memcpy, not the torch ops against torch copies that "kernels" measures
// (benchmarks/bench_kernels.py). Flags: kvb_bench_kernels --help.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "benchlib.h"
#include "kvbridge/kernels/cuda_memory.h"
#include "kvbridge/kernels/page_copy.h"

namespace {

namespace bl = kvbridge::benchlib;
using Clock = std::chrono::steady_clock;

struct Args {
  bool quick = false;
  bool gpu = true;
  int threads = 2;
  double seconds = 1.0;  // per measured trial of one operation
  int64_t pages = 0;     // pages per copy; 0: by mode
  bool no_gpu = false;
};

constexpr int64_t kLayers = 8;
constexpr int64_t kKv = 2;
constexpr int64_t kRowBytes = 8 * 128 * 2;  // 8 heads x head_dim 128 x bf16

void Check(int rc, const char* what, const char* err) {
  if (rc != KVB_KERNEL_OK) {
    std::fprintf(stderr, "kvb_bench_kernels: %s: %s: %s\n", what, kvb_kernel_status_name(rc), err);
    std::exit(1);
  }
}

// Runs op repeatedly for about `seconds`; returns GB/s for `bytes` per run.
double Rate(const std::function<void()>& op, int64_t bytes, double seconds) {
  op();  // warm
  int64_t runs = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  do {
    op();
    ++runs;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  return bl::Gbps(static_cast<double>(bytes) * static_cast<double>(runs), elapsed);
}

// The median of the trials by the benchmarks' one percentile rule (benchlib.h).
double Median(const std::vector<double>& v) { return bl::Percentile(v, 50); }

// memcpy of `bytes` split into `threads` contiguous parts.
void ParallelMemcpy(char* dst, const char* src, int64_t bytes, int threads) {
  std::vector<std::thread> workers;
  auto part = [&](int k) { return bytes * k / threads; };
  for (int k = 1; k < threads; ++k) {
    workers.emplace_back([=] { std::memcpy(dst + part(k), src + part(k), part(k + 1) - part(k)); });
  }
  std::memcpy(dst, src, static_cast<size_t>(part(1)));
  for (auto& w : workers) w.join();
}

// The per-row loop one writes first: one thread, one memcpy per row.
void NaiveRows(const kvb_page_copy_desc& d) {
  for (int64_t i = 0; i < d.n_pages; ++i) {
    for (int64_t layer = 0; layer < d.n_layers; ++layer) {
      for (int64_t kv = 0; kv < d.n_kv; ++kv) {
        auto plane = [&](const kvb_page_side& s, int64_t page) {
          char* base = s.layer_ptrs != nullptr
                           ? static_cast<char*>(s.layer_ptrs[kv * s.table_kv_stride + layer])
                           : static_cast<char*>(s.base) + layer * s.layer_stride_bytes;
          return base + kv * s.kv_stride_bytes + page * s.page_stride_bytes;
        };
        const char* src = plane(d.src, d.src_pages[i]);
        char* dst = plane(d.dst, d.dst_pages[i]);
        for (int64_t r = 0; r < d.rows; ++r) {
          std::memcpy(dst + r * d.dst.row_stride_bytes, src + r * d.src.row_stride_bytes,
                      static_cast<size_t>(d.row_bytes));
        }
      }
    }
  }
}

struct Result {
  std::string layout, direction;
  int64_t page_size, chunk_bytes, page_bytes;
  double gbps, baseline_gbps, naive_gbps;
};

// Device pool (per-layer buffers in one allocation) and host pool of `pages` pages each.
struct Pools {
  int64_t page_size, pages;
  std::vector<char*> table;
  char* device = nullptr;
  char* host = nullptr;
  std::vector<int64_t> device_pages, host_pages;
};

void MakeIndices(Pools* p) {
  p->device_pages.resize(static_cast<size_t>(p->pages));
  p->host_pages.resize(static_cast<size_t>(p->pages));
  std::iota(p->device_pages.begin(), p->device_pages.end(), 0);
  std::iota(p->host_pages.begin(), p->host_pages.end(), 0);
  // HiCache backs up device pages scattered by the radix tree into freshly allocated host pages.
  std::shuffle(p->device_pages.begin(), p->device_pages.end(), std::mt19937_64(42));
}

kvb_page_copy_desc Desc(const Pools& p, kvb_sglang_layout layout, bool pack,
                        const int64_t* device_pages, const int64_t* host_pages,
                        void* const* device_table_gpu) {
  char err[512] = "";
  kvb_page_side dev, host;
  kvb_page_geometry gd, gh;
  const int64_t slots = p.pages * p.page_size;
  Check(kvb_sglang_device_side(&dev, &gd, reinterpret_cast<void* const*>(p.table.data()),
                               device_table_gpu, kLayers, kKv, slots, p.page_size, kRowBytes, err,
                               sizeof(err)),
        "device side", err);
  Check(kvb_sglang_host_side(&host, &gh, layout, p.host, kLayers, kKv, slots, p.page_size,
                             kRowBytes, err, sizeof(err)),
        "host side", err);
  kvb_page_copy_desc d;
  if (pack) {
    Check(kvb_page_copy_desc_init(&d, &dev, &gd, &host, &gh, device_pages, host_pages, p.pages, err,
                                  sizeof(err)),
          "desc", err);
  } else {
    Check(kvb_page_copy_desc_init(&d, &host, &gh, &dev, &gd, host_pages, device_pages, p.pages, err,
                                  sizeof(err)),
          "desc", err);
  }
  return d;
}

struct Config {
  kvb_sglang_layout layout;
  bool pack;
};

const Config kConfigs[] = {{KVB_SGLANG_PAGE_FIRST, true},
                           {KVB_SGLANG_PAGE_FIRST, false},
                           {KVB_SGLANG_PAGE_FIRST_DIRECT, true},
                           {KVB_SGLANG_LAYER_FIRST, true}};

std::vector<Result> RunCpu(const Args& a, const std::vector<int64_t>& page_sizes) {
  std::vector<Result> results;
  const int trials = a.quick ? 3 : 5;
  for (int64_t page_size : page_sizes) {
    Pools p;
    p.page_size = page_size;
    const int64_t page_bytes = kLayers * kKv * page_size * kRowBytes;
    p.pages = a.pages > 0 ? a.pages : std::max<int64_t>(8, (a.quick ? 48 : 192) * 32 / page_size);
    const int64_t bytes = p.pages * page_bytes;
    std::vector<char> device(static_cast<size_t>(bytes)), host(static_cast<size_t>(bytes));
    std::memset(device.data(), 1, device.size());  // fault the pages in
    std::memset(host.data(), 2, host.size());
    p.device = device.data();
    p.host = host.data();
    const int64_t layer_bytes = p.pages * page_size * kRowBytes;
    for (int64_t i = 0; i < kKv * kLayers; ++i) p.table.push_back(p.device + i * layer_bytes);
    MakeIndices(&p);
    for (const Config& c : kConfigs) {
      const kvb_page_copy_desc d =
          Desc(p, c.layout, c.pack, p.device_pages.data(), p.host_pages.data(), nullptr);
      char* from = c.pack ? p.device : p.host;
      char* to = c.pack ? p.host : p.device;
      std::vector<double> kernel, plain, naive;
      for (int t = 0; t < trials; ++t) {
        plain.push_back(
            Rate([&] { ParallelMemcpy(to, from, bytes, a.threads); }, bytes, a.seconds));
        kernel.push_back(Rate(
            [&] {
              char err[512] = "";
              Check(kvb_page_copy_cpu(&d, a.threads, err, sizeof(err)), "kvb_page_copy_cpu", err);
            },
            bytes, a.seconds));
      }
      naive.push_back(Rate([&] { NaiveRows(d); }, bytes, a.seconds));
      Result r{kvb_sglang_layout_name(c.layout),
               c.pack ? "pack" : "unpack",
               page_size,
               page_size * kRowBytes,
               page_bytes,
               Median(kernel),
               Median(plain),
               Median(naive)};
      std::fprintf(stderr,
                   "cpu  %-17s %-6s page_size %3lld (%4lld KiB per layer and K/V): %6.2f GB/s, "
                   "memcpy %6.2f GB/s (ratio %.2f), naive per-row loop %6.2f GB/s\n",
                   r.layout.c_str(), r.direction.c_str(), static_cast<long long>(page_size),
                   static_cast<long long>(r.chunk_bytes >> 10), r.gbps, r.baseline_gbps,
                   r.gbps / r.baseline_gbps, r.naive_gbps);
      results.push_back(r);
    }
  }
  return results;
}

// GPU memory freed on scope exit.
struct GpuBuffer {
  void* ptr = nullptr;
  bool pinned = false;
  GpuBuffer(size_t bytes, bool pinned_host) : pinned(pinned_host) {
    char err[512] = "";
    Check(pinned ? kvb_cuda_malloc_host(&ptr, bytes, err, sizeof(err))
                 : kvb_cuda_malloc(&ptr, bytes, err, sizeof(err)),
          pinned ? "cudaHostAlloc" : "cudaMalloc", err);
  }
  ~GpuBuffer() { pinned ? kvb_cuda_free_host(ptr) : kvb_cuda_free(ptr); }
  char* data() const { return static_cast<char*>(ptr); }
};

double GpuRate(const std::function<void()>& enqueue, int64_t bytes, int reps) {
  char err[512] = "";
  enqueue();  // warm
  Check(kvb_cuda_stream_synchronize(nullptr, err, sizeof(err)), "warm-up", err);
  const auto start = Clock::now();
  for (int i = 0; i < reps; ++i) enqueue();
  Check(kvb_cuda_stream_synchronize(nullptr, err, sizeof(err)), "timed run", err);
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  return bl::Gbps(static_cast<double>(bytes) * reps, s);
}

// Returns the "gpu" JSON member's value.
std::string RunGpu(const Args& a, double* headline_ratio) {
  char err[512] = "";
  int count = 0;
  const int rc = kvb_cuda_device_count(&count, err, sizeof(err));
  if (rc != KVB_KERNEL_OK || count == 0) {
    std::fprintf(stderr, "gpu: not measured: %s: %s\n", kvb_kernel_status_name(rc), err);
    bl::Json j;
    j.BeginObject()
        .Field("available", false)
        .Field("reason", std::string(kvb_kernel_status_name(rc)) + ": " + err)
        .EndObject();
    return j.str();
  }
  char name[256] = "";
  Check(kvb_cuda_device_name(name, sizeof(name), err, sizeof(err)), "device name", err);
  std::fprintf(stderr, "gpu: %s\n", name);
  const int reps = a.quick ? 10 : 30;
  bl::Json items;
  items.BeginArray();
  double pf_sum = 0, d2d_sum = 0;
  int pf_n = 0;
  for (int64_t page_size : {int64_t{16}, int64_t{32}, int64_t{64}}) {
    Pools p;
    p.page_size = page_size;
    const int64_t page_bytes = kLayers * kKv * page_size * kRowBytes;
    p.pages = (a.quick ? 1024 : 2048) * 32 / page_size;  // 1 or 2 GiB per pool
    const int64_t bytes = p.pages * page_bytes;
    GpuBuffer device(static_cast<size_t>(bytes), false), host(static_cast<size_t>(bytes), false);
    GpuBuffer pinned(static_cast<size_t>(bytes), true);
    Check(kvb_cuda_memset(device.ptr, 1, static_cast<size_t>(bytes), err, sizeof(err)), "memset",
          err);
    p.device = device.data();
    const int64_t layer_bytes = p.pages * page_size * kRowBytes;
    for (int64_t i = 0; i < kKv * kLayers; ++i) p.table.push_back(p.device + i * layer_bytes);
    MakeIndices(&p);
    const size_t index_bytes = static_cast<size_t>(p.pages) * sizeof(int64_t);
    GpuBuffer dev_idx(index_bytes, false), host_idx(index_bytes, false);
    Check(kvb_cuda_memcpy(dev_idx.ptr, p.device_pages.data(), index_bytes, err, sizeof(err)),
          "indices", err);
    Check(kvb_cuda_memcpy(host_idx.ptr, p.host_pages.data(), index_bytes, err, sizeof(err)),
          "indices", err);
    const auto* di = static_cast<const int64_t*>(dev_idx.ptr);
    const auto* hi = static_cast<const int64_t*>(host_idx.ptr);
    const double d2d = GpuRate(
        [&] {
          Check(kvb_cuda_memcpy_async(host.ptr, device.ptr, static_cast<size_t>(bytes), nullptr,
                                      err, sizeof(err)),
                "cudaMemcpyAsync", err);
        },
        bytes, reps);
    const double d2h = GpuRate(
        [&] {
          Check(kvb_cuda_memcpy_async(pinned.ptr, device.ptr, static_cast<size_t>(bytes), nullptr,
                                      err, sizeof(err)),
                "cudaMemcpyAsync", err);
        },
        bytes, std::max(2, reps / 5));
    for (const Config& c : kConfigs) {
      for (bool to_pinned : {false, true}) {
        if (to_pinned && !(c.layout == KVB_SGLANG_PAGE_FIRST && c.pack)) continue;
        p.host = to_pinned ? pinned.data() : host.data();
        const kvb_page_copy_desc d = Desc(p, c.layout, c.pack, di, hi, nullptr);
        const double gbps = GpuRate(
            [&] {
              Check(kvb_page_copy_cuda(&d, nullptr, err, sizeof(err)), "kvb_page_copy_cuda", err);
            },
            bytes, to_pinned ? std::max(2, reps / 5) : reps);
        const double base = to_pinned ? d2h : d2d;
        const char* target = to_pinned ? "pinned host" : "device";
        std::fprintf(stderr,
                     "gpu  %-17s %-6s to %-11s page_size %3lld (%4lld KiB per layer and K/V): "
                     "%7.1f GB/s, cudaMemcpy %s %7.1f GB/s (ratio %.2f)\n",
                     kvb_sglang_layout_name(c.layout), c.pack ? "pack" : "unpack", target,
                     static_cast<long long>(page_size),
                     static_cast<long long>(page_size * kRowBytes >> 10), gbps,
                     to_pinned ? "D2H" : "D2D", base, gbps / base);
        items.BeginObject()
            .Field("layout", kvb_sglang_layout_name(c.layout))
            .Field("direction", c.pack ? "pack" : "unpack")
            .Field("memory", target)
            .Field("page_size", page_size)
            .Field("chunk_bytes", page_size * kRowBytes)
            .Field("gbps", gbps, 1)
            .Field("baseline_name", to_pinned ? "cudaMemcpy D2H" : "cudaMemcpy D2D")
            .Field("baseline_gbps", base, 1)
            .Field("ratio", bl::Ratio(gbps, base), 3)
            .EndObject();
        if (!to_pinned && c.layout == KVB_SGLANG_PAGE_FIRST && c.pack &&
            page_size * kRowBytes >= 64 * 1024) {
          pf_sum += gbps;
          d2d_sum += d2d;
          ++pf_n;
        }
      }
    }
  }
  items.EndArray();
  const double value = pf_n ? pf_sum / pf_n : std::nan(""),
               baseline = pf_n ? d2d_sum / pf_n : std::nan("");
  *headline_ratio = bl::Ratio(value, baseline);
  bl::Json j;
  j.BeginObject()
      .Field("available", true)
      .Field("device", name)
      .Key("headline")
      .BeginObject()
      .Field("metric",
             "page_first pack GB/s (CUDA, >=64KiB per layer and K/V) / cudaMemcpy D2D GB/s")
      .Field("value", value, 1)
      .Field("baseline", baseline, 1)
      .Field("baseline_name", "cudaMemcpy device-to-device of the same bytes, same run")
      .Field("ratio", *headline_ratio, 3)
      .Field("goal", 0.85, 2)
      .EndObject()
      .Key("results")
      .Raw(items.str())
      .EndObject();
  return j.str();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bl::Flags f("kvb_bench_kernels",
              "GB/s of the page-copy C API per SGLang host layout against memcpy (and "
              "cudaMemcpy with a GPU)\nin the same run (benchmarks/run kernels-c; "
              "docs/benchmarks.md).");
  f.Bool("quick", &a.quick, "one page size, 3 trials, --seconds 0.2 unless given");
  f.Int("threads", &a.threads, "CPU threads for the kernel and for memcpy", 1);
  f.Double("seconds", &a.seconds, "seconds per measured trial of one operation", 0.001);
  f.Int64("pages", &a.pages, "pages per copy (0: by mode)", 0);
  f.Bool("no-gpu", &a.no_gpu, "CPU only");
  f.ParseOrExit(argc, argv);
  a.gpu = !a.no_gpu;
  if (a.quick && !f.Given("seconds")) a.seconds = 0.2;
  std::fprintf(stderr, "kvb_bench_kernels: %d layers, K and V, rows of %lld bytes, %d threads%s\n",
               static_cast<int>(kLayers), static_cast<long long>(kRowBytes), a.threads,
               a.quick ? ", quick" : "");

  const std::vector<int64_t> page_sizes =
      a.quick ? std::vector<int64_t>{32} : std::vector<int64_t>{32, 64, 128};
  const std::vector<Result> cpu = RunCpu(a, page_sizes);
  bl::Json items;
  items.BeginArray();
  double value = 0, baseline = 0;
  int n = 0;
  for (const Result& r : cpu) {
    items.BeginObject()
        .Field("engine", "cpu")
        .Field("layout", r.layout)
        .Field("direction", r.direction)
        .Field("page_size", r.page_size)
        .Field("chunk_bytes", r.chunk_bytes)
        .Field("page_bytes", r.page_bytes)
        .Field("gbps", r.gbps, 3)
        .Field("baseline_name", "memcpy")
        .Field("baseline_gbps", r.baseline_gbps, 3)
        .Field("ratio", bl::Ratio(r.gbps, r.baseline_gbps), 3)
        .Field("naive_gbps", r.naive_gbps, 3)
        .Field("ratio_vs_naive", bl::Ratio(r.gbps, r.naive_gbps), 3)
        .EndObject();
    if (r.layout == "page_first" && r.direction == "pack") {
      value += r.gbps;
      baseline += r.baseline_gbps;
      ++n;
    }
  }
  items.EndArray();
  value = n ? value / n : std::nan("");
  baseline = n ? baseline / n : std::nan("");
  double gpu_ratio = 0;
  std::string gpu;
  if (a.gpu) {
    gpu = RunGpu(a, &gpu_ratio);
  } else {
    bl::Json g;
    g.BeginObject().Field("available", false).Field("reason", "--no-gpu").EndObject();
    gpu = g.str();
  }
  bl::Json j;
  j.BeginObject()
      .Field("benchmark", "kernels-c")
      .Field("implementation", "page-copy C API (kvb_page_copy_cpu / kvb_page_copy_cuda)")
      .Field("quick", a.quick)
      .Field("threads", a.threads)
      .Key("headline")
      .BeginObject()
      .Field("metric", "page_first pack GB/s (CPU) / memcpy GB/s")
      .Field("value", value, 3)
      .Field("baseline", baseline, 3)
      .Field("baseline_name", "memcpy of the same bytes, same threads, same run")
      .Field("ratio", bl::Ratio(value, baseline), 3)
      .Field("goal", 0.6, 1)
      .EndObject()
      .Key("gpu")
      .Raw(gpu)
      .Key("results")
      .Raw(items.str())
      .EndObject();
  bl::PrintResult(j);
  return 0;
}
