// The metrics registry and its exposition text: every line parsed back and checked against the
// 0.0.4 text format's rules (one HELP and TYPE per name before its samples, escaped label
// values, cumulative buckets ending in +Inf equal to _count).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "obs/metrics.h"
#include "tests/common/http_get.h"

namespace kvbridge::obs {
namespace {

using testing::ParseSamples;

// Checks the structure of an exposition; "" when it holds, else the first rule broken.
std::string CheckFormat(const std::string& text) {
  std::map<std::string, std::string> type_of;
  std::set<std::string> helped;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) return "last line not terminated";
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.rfind("# HELP ", 0) == 0) {
      const std::string name = line.substr(7, line.find(' ', 7) - 7);
      if (!helped.insert(name).second) return "second HELP for " + name;
      continue;
    }
    if (line.rfind("# TYPE ", 0) == 0) {
      const size_t sp = line.find(' ', 7);
      const std::string name = line.substr(7, sp - 7);
      if (type_of.count(name)) return "second TYPE for " + name;
      if (!helped.count(name)) return "TYPE before HELP for " + name;
      type_of[name] = line.substr(sp + 1);
      continue;
    }
    size_t name_end = 0;
    while (name_end < line.size() && (std::isalnum(static_cast<unsigned char>(line[name_end])) ||
                                      line[name_end] == '_' || line[name_end] == ':')) {
      ++name_end;
    }
    std::string name = line.substr(0, name_end);
    if (name.empty()) return "sample without a name: " + line;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0 &&
          type_of.count(name.substr(0, name.size() - s.size())) &&
          type_of[name.substr(0, name.size() - s.size())] == "histogram") {
        name = name.substr(0, name.size() - s.size());
      }
    }
    if (!type_of.count(name)) return "sample before its TYPE: " + line;
    size_t i = name_end;
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        while (i < line.size() && line[i] != '=') ++i;
        if (i + 1 >= line.size() || line[i + 1] != '"') return "label without quotes: " + line;
        i += 2;
        while (i < line.size() && line[i] != '"') {
          if (line[i] == '\\') {
            if (i + 1 >= line.size() || std::string("\\\"n").find(line[i + 1]) == std::string::npos)
              return "bad escape: " + line;
            ++i;
          }
          ++i;
        }
        ++i;  // closing quote
        if (i < line.size() && line[i] == ',') ++i;
      }
      ++i;
    }
    if (i >= line.size() || line[i] != ' ') return "no space before the value: " + line;
  }
  return "";
}

TEST(Metrics, CountersGaugesAndLabelsRenderParsable) {
  Registry r;
  r.Counter("kvb_test_puts_total", "Puts.", {{"tier", "dram"}})->Inc(3);
  r.Counter("kvb_test_puts_total", "Puts.", {{"tier", "ssd"}})->Inc();
  r.Counter("kvb_test_puts_total", "Puts.", {{"tier", "dram"}})->Inc(2);  // the same counter
  r.Gauge("kvb_test_used_bytes", "Used.")->Set(1.5);
  const std::string text = r.Render();
  EXPECT_EQ(CheckFormat(text), "") << text;
  auto s = ParseSamples(text);
  EXPECT_EQ(s["kvb_test_puts_total{tier=\"dram\"}"], 5);
  EXPECT_EQ(s["kvb_test_puts_total{tier=\"ssd\"}"], 1);
  EXPECT_EQ(s["kvb_test_used_bytes"], 1.5);
  EXPECT_NE(text.find("# TYPE kvb_test_puts_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE kvb_test_used_bytes gauge\n"), std::string::npos);
}

TEST(Metrics, LabelValuesAndHelpAreEscaped) {
  Registry r;
  r.Gauge("kvb_test_g", "line one\nback\\slash", {{"node", "a\"b\\c\nd"}})->Set(1);
  const std::string text = r.Render();
  EXPECT_EQ(CheckFormat(text), "") << text;
  EXPECT_NE(text.find("# HELP kvb_test_g line one\\nback\\\\slash\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvb_test_g{node=\"a\\\"b\\\\c\\nd\"} 1\n"), std::string::npos) << text;
}

TEST(Metrics, HistogramBucketsAreCumulativeWithInf) {
  Registry r;
  Histogram* h = r.Histogram("kvb_test_seconds", "Latency.", {{"op", "put"}}, {0.1, 1, 10});
  for (double v : {0.05, 0.1, 0.5, 2.0, 20.0}) h->Observe(v);
  const std::string text = r.Render();
  EXPECT_EQ(CheckFormat(text), "") << text;
  auto s = ParseSamples(text);
  EXPECT_EQ(s["kvb_test_seconds_bucket{op=\"put\",le=\"0.1\"}"], 2);  // 0.1 is <= 0.1
  EXPECT_EQ(s["kvb_test_seconds_bucket{op=\"put\",le=\"1\"}"], 3);
  EXPECT_EQ(s["kvb_test_seconds_bucket{op=\"put\",le=\"10\"}"], 4);
  EXPECT_EQ(s["kvb_test_seconds_bucket{op=\"put\",le=\"+Inf\"}"], 5);
  EXPECT_EQ(s["kvb_test_seconds_count{op=\"put\"}"], 5);
  EXPECT_DOUBLE_EQ(s["kvb_test_seconds_sum{op=\"put\"}"], 22.65);
  EXPECT_NE(text.find("# TYPE kvb_test_seconds histogram\n"), std::string::npos);
}

TEST(Metrics, CollectorsJoinFamiliesOfTheSameName) {
  Registry r;
  r.AddCollector([](MetricWriter& w) {
    w.Gauge("kvb_test_node_bytes", "Bytes per node.", {{"node", "n1"}}, 10);
    w.Gauge("kvb_test_node_bytes", "Bytes per node.", {{"node", "n2"}}, 20);
    w.Counter("kvb_test_expired_total", "Expired.", {}, 7);
  });
  r.AddCollector([](MetricWriter& w) {
    w.Gauge("kvb_test_node_bytes", "Bytes per node.", {{"node", "n3"}}, 30);
  });
  const std::string text = r.Render();
  EXPECT_EQ(CheckFormat(text), "") << text;
  auto s = ParseSamples(text);
  EXPECT_EQ(s["kvb_test_node_bytes{node=\"n1\"}"], 10);
  EXPECT_EQ(s["kvb_test_node_bytes{node=\"n3\"}"], 30);
  EXPECT_EQ(s["kvb_test_expired_total"], 7);
}

TEST(Metrics, ValuesFormat) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(1ull << 40), "1099511627776");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(HUGE_VAL), "+Inf");
  EXPECT_EQ(FormatValue(-HUGE_VAL), "-Inf");
  EXPECT_EQ(FormatValue(NAN), "NaN");
}

TEST(Metrics, ConcurrentUpdatesAreAllCounted) {
  Registry r;
  Counter* c = r.Counter("kvb_test_ops_total", "Ops.");
  Histogram* h = r.Histogram("kvb_test_op_seconds", "Op latency.");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        c->Inc();
        h->Observe(0.001);
      }
    });
  }
  std::string during;
  for (int i = 0; i < 20; ++i) during = r.Render();  // renders race with the updates
  for (auto& t : threads) t.join();
  EXPECT_EQ(CheckFormat(during), "");
  auto s = ParseSamples(r.Render());
  EXPECT_EQ(s["kvb_test_ops_total"], 40000);
  EXPECT_EQ(s["kvb_test_op_seconds_count"], 40000);
  EXPECT_NEAR(s["kvb_test_op_seconds_sum"], 40.0, 1e-6);
}

}  // namespace
}  // namespace kvbridge::obs
