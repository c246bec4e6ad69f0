#include "obs/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace kvbridge::obs {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += buckets_[i].load(std::memory_order_relaxed);
    out[i] = total;
  }
  return out;
}

const std::vector<double>& LatencyBucketsSeconds() {
  static const std::vector<double> b = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                        0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
  return b;
}

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  // Counts and byte sizes print as integers (exact up to 2^53).
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {
    auto r = std::to_chars(buf, buf + sizeof(buf), static_cast<int64_t>(v));
    return std::string(buf, r.ptr);
  }
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

MetricWriter::Family& MetricWriter::FamilyOf(std::string_view name, std::string_view help,
                                             std::string_view type) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(std::string(name), Family{std::string(help), std::string(type), {}})
             .first;
  }
  return it->second;
}

void MetricWriter::Gauge(std::string_view name, std::string_view help, const Labels& labels,
                         double value) {
  FamilyOf(name, help, "gauge").samples.push_back({"", labels, value});
}

void MetricWriter::Counter(std::string_view name, std::string_view help, const Labels& labels,
                           double value) {
  FamilyOf(name, help, "counter").samples.push_back({"", labels, value});
}

struct Registry::State {
  struct Entry {
    Labels labels;
    std::unique_ptr<obs::Counter> counter;
    std::unique_ptr<obs::Gauge> gauge;
    std::unique_ptr<obs::Histogram> histogram;
  };
  struct Family {
    std::string help;
    std::string type;
    std::vector<std::unique_ptr<Entry>> entries;
  };
  mutable std::mutex mu;
  std::map<std::string, Family> families;
  std::vector<std::function<void(MetricWriter&)>> collectors;

  Entry* Find(const std::string& name, const std::string& help, const char* type,
              const Labels& labels, bool* made) {
    Family& f = families[name];
    if (f.type.empty()) {
      f.help = help;
      f.type = type;
    }
    for (auto& e : f.entries) {
      if (e->labels == labels) {
        *made = false;
        return e.get();
      }
    }
    f.entries.push_back(std::make_unique<Entry>());
    f.entries.back()->labels = labels;
    *made = true;
    return f.entries.back().get();
  }
};

Registry::Registry() : state_(std::make_unique<State>()) {}
Registry::~Registry() = default;

obs::Counter* Registry::Counter(const std::string& name, const std::string& help,
                                const Labels& labels) {
  std::lock_guard<std::mutex> lock(state_->mu);
  bool made;
  State::Entry* e = state_->Find(name, help, "counter", labels, &made);
  if (made) e->counter = std::make_unique<obs::Counter>();
  return e->counter.get();
}

obs::Gauge* Registry::Gauge(const std::string& name, const std::string& help,
                            const Labels& labels) {
  std::lock_guard<std::mutex> lock(state_->mu);
  bool made;
  State::Entry* e = state_->Find(name, help, "gauge", labels, &made);
  if (made) e->gauge = std::make_unique<obs::Gauge>();
  return e->gauge.get();
}

obs::Histogram* Registry::Histogram(const std::string& name, const std::string& help,
                                    const Labels& labels, const std::vector<double>& bounds) {
  std::lock_guard<std::mutex> lock(state_->mu);
  bool made;
  State::Entry* e = state_->Find(name, help, "histogram", labels, &made);
  if (made) e->histogram = std::make_unique<obs::Histogram>(bounds);
  return e->histogram.get();
}

void Registry::AddCollector(std::function<void(MetricWriter&)> collector) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->collectors.push_back(std::move(collector));
}

namespace {

void AppendSample(std::string* out, const std::string& name, const std::string& suffix,
                  const Labels& labels, double value) {
  *out += name;
  *out += suffix;
  if (!labels.empty()) {
    *out += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i) *out += ',';
      *out += labels[i].first;
      *out += "=\"";
      *out += EscapeLabelValue(labels[i].second);
      *out += '"';
    }
    *out += '}';
  }
  *out += ' ';
  *out += FormatValue(value);
  *out += '\n';
}

}  // namespace

std::string Registry::Render() const {
  MetricWriter w;
  std::vector<std::function<void(MetricWriter&)>> collectors;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (const auto& [name, f] : state_->families) {
      MetricWriter::Family& out = w.FamilyOf(name, f.help, f.type);
      for (const auto& e : f.entries) {
        if (e->counter) {
          out.samples.push_back({"", e->labels, static_cast<double>(e->counter->value())});
        } else if (e->gauge) {
          out.samples.push_back({"", e->labels, e->gauge->value()});
        } else if (e->histogram) {
          const obs::Histogram& h = *e->histogram;
          const std::vector<uint64_t> cumulative = h.CumulativeCounts();
          for (size_t i = 0; i < cumulative.size(); ++i) {
            Labels l = e->labels;
            l.emplace_back("le", i < h.bounds().size() ? FormatValue(h.bounds()[i]) : "+Inf");
            out.samples.push_back({"_bucket", std::move(l), static_cast<double>(cumulative[i])});
          }
          out.samples.push_back({"_sum", e->labels, h.sum()});
          // The +Inf bucket, read together with the others, so that _count matches it.
          out.samples.push_back({"_count", e->labels, static_cast<double>(cumulative.back())});
        }
      }
    }
    collectors = state_->collectors;
  }
  for (const auto& c : collectors) c(w);
  std::string out;
  for (const auto& [name, f] : w.families_) {
    if (f.samples.empty()) continue;
    out += "# HELP " + name + " " + EscapeHelp(f.help) + "\n";
    out += "# TYPE " + name + " " + f.type + "\n";
    for (const auto& s : f.samples) AppendSample(&out, name, s.suffix, s.labels, s.value);
  }
  return out;
}

}  // namespace kvbridge::obs
