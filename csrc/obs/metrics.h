// Metrics of a daemon, rendered in the Prometheus text exposition format (version 0.0.4):
// counters, gauges and histograms registered once and updated on the hot path with relaxed
// atomics, plus collectors that report values other structures already keep, read at scrape
// time (the master's table, an engine's transport counters). docs/operations.md lists what the
// daemons expose.
//
// Thread-safety: a Registry may be rendered while its metrics are updated from any thread and
// while metrics or collectors are added. Counter, Gauge and Histogram updates take no lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvbridge::obs {

// Label names and values, in the order they are printed. Names must match
// [a-zA-Z_][a-zA-Z0-9_]*; values are any UTF-8 (escaped on output).
using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Inc(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double d) { value_.fetch_add(d, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted into fixed buckets by upper bound (each bucket counts the values <= its
// bound and above the previous one; rendering makes them cumulative, with +Inf last).
class Histogram {
 public:
  // REQUIRES: bounds strictly increasing, finite.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // Cumulative counts per bound, then the +Inf count (= count()).
  std::vector<uint64_t> CumulativeCounts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1 (the last: +Inf)
  std::atomic<double> sum_{0};
  std::atomic<uint64_t> count_{0};
};

// Latency buckets in seconds, 100 us to 10 s: what a control-plane call or a transfer takes.
const std::vector<double>& LatencyBucketsSeconds();

// Values a collector reports at scrape time. Samples of one name must share its type and help
// (the first one given wins).
class MetricWriter {
 public:
  void Gauge(std::string_view name, std::string_view help, const Labels& labels, double value);
  void Counter(std::string_view name, std::string_view help, const Labels& labels, double value);

 private:
  friend class Registry;
  struct Sample {
    std::string suffix;  // "", "_bucket", "_sum", "_count"
    Labels labels;
    double value = 0;
  };
  struct Family {
    std::string help;
    std::string type;  // counter, gauge, histogram
    std::vector<Sample> samples;
  };
  Family& FamilyOf(std::string_view name, std::string_view help, std::string_view type);
  std::map<std::string, Family, std::less<>> families_;
};

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The metric of `name` with `labels`, made on first use (the same pointer every time after);
  // owned by the registry. REQUIRES: a name is used with one type (and, for a histogram, one
  // set of bounds).
  obs::Counter* Counter(const std::string& name, const std::string& help,
                        const Labels& labels = {});
  obs::Gauge* Gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  obs::Histogram* Histogram(const std::string& name, const std::string& help,
                            const Labels& labels = {},
                            const std::vector<double>& bounds = LatencyBucketsSeconds());
  // Called on every Render(), in the order added, with no lock of the registry held.
  void AddCollector(std::function<void(MetricWriter&)> collector);

  // The exposition text: one HELP and TYPE line per metric name, names in lexical order.
  std::string Render() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The exposition format's escaping: label values escape backslash, double quote and newline;
// HELP text escapes backslash and newline.
std::string EscapeLabelValue(std::string_view v);
std::string EscapeHelp(std::string_view v);
// A sample value: integers without a fraction, else shortest round-trip; +Inf, -Inf, NaN.
std::string FormatValue(double v);

// The Content-Type of Render()'s text.
inline constexpr const char* kExpositionContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace kvbridge::obs
