// benchlib (benchmarks/benchlib/benchlib.h): the nearest-rank percentile on known samples,
// flag parsing and its errors, rates, whole-buffer socket I/O, and the JSON writer's output and
// escaping.
#include "benchlib.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace kvbridge::benchlib {
namespace {

Samples Of(std::vector<double> v) {
  Samples s;
  for (double x : v) s.Add(x);
  return s;
}

TEST(BenchlibPercentile, NearestRankOnOneToHundred) {
  Samples s;
  for (int i = 100; i >= 1; --i) s.Add(i);  // unsorted on purpose
  EXPECT_EQ(s.Percentile(0), 1);
  EXPECT_EQ(s.Percentile(1), 1);
  EXPECT_EQ(s.Percentile(29), 29);  // 0.29 * 100 is 29.000000000000004 in binary
  EXPECT_EQ(s.Percentile(50), 50);
  EXPECT_EQ(s.Percentile(50.5), 51);
  EXPECT_EQ(s.Percentile(99), 99);
  EXPECT_EQ(s.Percentile(99.5), 100);
  EXPECT_EQ(s.Percentile(100), 100);
  EXPECT_EQ(s.Median(), 50);
  EXPECT_EQ(s.Min(), 1);
  EXPECT_EQ(s.Max(), 100);
  EXPECT_DOUBLE_EQ(s.Mean(), 50.5);
}

TEST(BenchlibPercentile, SmallSetsAndEdges) {
  const Samples one = Of({7.5});
  for (double p : {0.0, 1.0, 50.0, 99.0, 100.0}) EXPECT_EQ(one.Percentile(p), 7.5) << p;

  const Samples two = Of({20, 10});
  EXPECT_EQ(two.Percentile(0), 10);
  EXPECT_EQ(two.Percentile(50), 10);  // even count: the lower middle sample
  EXPECT_EQ(two.Percentile(50.1), 20);
  EXPECT_EQ(two.Percentile(100), 20);

  const Samples five = Of({5, 1, 4, 2, 3});
  EXPECT_EQ(five.Median(), 3);
  EXPECT_EQ(five.Percentile(20), 1);
  EXPECT_EQ(five.Percentile(21), 2);
  EXPECT_EQ(five.Percentile(99), 5);

  // out-of-range p is clamped
  EXPECT_EQ(five.Percentile(-5), 1);
  EXPECT_EQ(five.Percentile(250), 5);

  const Samples none;
  EXPECT_TRUE(std::isnan(none.Percentile(50)));
  EXPECT_TRUE(std::isnan(none.Mean()));
  EXPECT_TRUE(std::isnan(Percentile({}, 99)));
  EXPECT_EQ(Percentile({3, 1, 2}, 50), 2);
}

TEST(BenchlibPercentile, MergeAndAddAfterAQuery) {
  Samples a = Of({1, 2, 3});
  EXPECT_EQ(a.Max(), 3);
  a.Add(0);  // added after a sort: must be sorted in again
  EXPECT_EQ(a.Min(), 0);
  a.Merge(Of({10, 11}));
  EXPECT_EQ(a.count(), 6u);
  EXPECT_EQ(a.Max(), 11);
  EXPECT_EQ(a.Median(), 2);  // ranks: 0 1 2 3 10 11, rank 3
  const Summary s = Summarize(a);
  EXPECT_EQ(s.count, 6u);
  EXPECT_EQ(s.min, 0);
  EXPECT_EQ(s.p50, 2);
  EXPECT_EQ(s.p99, 11);
  EXPECT_EQ(s.max, 11);
  EXPECT_DOUBLE_EQ(s.mean, 27.0 / 6);
}

TEST(BenchlibRates, GbpsIsDecimalAndRatioNamesMissingBaselines) {
  EXPECT_DOUBLE_EQ(Gbps(3e9, 2), 1.5);
  EXPECT_DOUBLE_EQ(Gbps(1 << 30, 1), 1.073741824);
  EXPECT_EQ(Gbps(100, 0), 0);
  EXPECT_DOUBLE_EQ(Ratio(3, 2), 1.5);
  EXPECT_TRUE(std::isnan(Ratio(3, 0)));
  EXPECT_TRUE(std::isnan(Ratio(3, -1)));
  EXPECT_TRUE(std::isnan(Ratio(std::nan(""), 2)));
  EXPECT_TRUE(std::isnan(Ratio(2, std::nan(""))));
}

// ------------------------------------------------------------------------------ flags

struct Parsed {
  Flags::Result result;
  std::string error;
};

struct Fixture {
  bool quick = false;
  int threads = 4;
  int64_t offset = -1;
  uint64_t mib = 1024;
  double seconds = 2.0;
  std::string io = "auto";
  std::string dir = "/tmp/x";
  std::vector<uint64_t> sizes = {64 << 10, 1 << 20};
  std::vector<std::string> config = {"default=1"};
  Flags flags{"prog", "does things"};
  Fixture() {
    flags.Bool("quick", &quick, "short run");
    flags.Int("threads", &threads, "threads", 1);
    flags.Int64("offset", &offset, "offset");
    flags.UInt64("mib", &mib, "MiB per size", 8);
    flags.Double("seconds", &seconds, "seconds per point", 0.001);
    flags.String("io", &io, "io engine", {"auto", "uring", "sync"});
    flags.String("dir", &dir, "directory");
    flags.UInt64List("sizes", &sizes, "sizes in KiB", 1024);
    flags.Repeated("config", &config, "key=value");
  }
  Parsed Parse(std::vector<const char*> args) {
    args.insert(args.begin(), "prog");
    Parsed p;
    p.result = flags.Parse(static_cast<int>(args.size()), args.data(), &p.error);
    return p;
  }
};

TEST(BenchlibFlags, DefaultsStayAndValuesParse) {
  Fixture f;
  ASSERT_EQ(f.Parse({}).result, Flags::Result::kOk);
  EXPECT_FALSE(f.quick);
  EXPECT_EQ(f.threads, 4);
  EXPECT_FALSE(f.flags.Given("threads"));

  Fixture g;
  const Parsed p = g.Parse({"--quick", "--threads", "8", "--offset=-3", "--mib", "16", "--seconds",
                            "0.25", "--io=sync", "--dir", "/d", "--sizes", "64,4096", "--config",
                            "a=1", "--config", "b=2"});
  ASSERT_EQ(p.result, Flags::Result::kOk) << p.error;
  EXPECT_TRUE(g.quick);
  EXPECT_EQ(g.threads, 8);
  EXPECT_EQ(g.offset, -3);
  EXPECT_EQ(g.mib, 16u);
  EXPECT_DOUBLE_EQ(g.seconds, 0.25);
  EXPECT_EQ(g.io, "sync");
  EXPECT_EQ(g.dir, "/d");
  EXPECT_EQ(g.sizes, (std::vector<uint64_t>{64 << 10, 4096ull << 10}));
  EXPECT_EQ(g.config, (std::vector<std::string>{"a=1", "b=2"}));  // default replaced
  EXPECT_TRUE(g.flags.Given("threads"));
  EXPECT_TRUE(g.flags.Given("--seconds"));
  EXPECT_FALSE(g.flags.Given("nope"));
}

TEST(BenchlibFlags, ErrorsNameTheFlagAndTheValue) {
  struct Case {
    std::vector<const char*> args;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{"--no-such-flag"}, "unknown flag --no-such-flag"},
      {{"--no-such=3"}, "unknown flag --no-such"},
      {{"stray"}, "unexpected argument 'stray'"},
      {{"--threads"}, "missing value for --threads"},
      {{"--threads", "four"}, "bad value 'four' for --threads: not an integer"},
      {{"--threads", "4x"}, "bad value '4x' for --threads: not an integer"},
      {{"--threads", ""}, "bad value '' for --threads: not an integer"},
      {{"--threads", "0"}, "bad value '0' for --threads: must be at least 1"},
      {{"--threads", "99999999999"}, "bad value '99999999999' for --threads: out of range"},
      {{"--mib", "-1"}, "bad value '-1' for --mib: not a non-negative integer"},
      {{"--mib", "4"}, "bad value '4' for --mib: must be at least 8"},
      {{"--seconds", "fast"}, "bad value 'fast' for --seconds: not a number"},
      {{"--seconds", "nan"}, "bad value 'nan' for --seconds: not a number"},
      {{"--seconds", "0"}, "bad value '0' for --seconds: must be at least 0.001"},
      {{"--io", "aio"}, "bad value 'aio' for --io: one of auto, uring, sync"},
      {{"--sizes", "64,,128"}, "bad value '64,,128' for --sizes: '' is not a non-negative"},
      {{"--sizes", "64,x"}, "bad value '64,x' for --sizes: 'x' is not a non-negative"},
      {{"--quick=1"}, "--quick takes no value"},
  };
  for (const Case& c : cases) {
    Fixture f;
    const Parsed p = f.Parse(c.args);
    EXPECT_EQ(p.result, Flags::Result::kError) << c.args[0];
    EXPECT_NE(p.error.find(c.error), std::string::npos) << "got: " << p.error;
  }
}

TEST(BenchlibFlags, HelpListsEveryDocumentedFlagWithItsDefault) {
  Fixture f;
  std::string internal = "x";
  f.flags.String("role", &internal, "");  // no help: accepted, not listed
  EXPECT_EQ(f.Parse({"--threads", "2", "--help"}).result, Flags::Result::kHelp);
  const std::string u = f.flags.Usage();
  EXPECT_NE(u.find("usage: prog"), std::string::npos) << u;
  EXPECT_NE(u.find("does things"), std::string::npos) << u;
  EXPECT_NE(u.find("--threads N"), std::string::npos) << u;
  EXPECT_NE(u.find("(default 4)"), std::string::npos) << u;
  EXPECT_NE(u.find("--io auto|uring|sync"), std::string::npos) << u;
  EXPECT_NE(u.find("--sizes N,N,..."), std::string::npos) << u;
  EXPECT_NE(u.find("(default 64,1024)"), std::string::npos) << u;  // in the flag's unit
  EXPECT_NE(u.find("(default 2)"), std::string::npos) << u;        // --seconds 2.0
  double twenty = 20, small = 0.25;
  Flags d("p", "s");
  d.Double("twenty", &twenty, "t");
  d.Double("small", &small, "s");
  EXPECT_NE(d.Usage().find("t (default 20)"), std::string::npos) << d.Usage();  // not 2e+01
  EXPECT_NE(d.Usage().find("s (default 0.25)"), std::string::npos) << d.Usage();
  EXPECT_NE(u.find("--quick"), std::string::npos) << u;
  EXPECT_EQ(u.find("--role"), std::string::npos) << u;
  Fixture g;
  g.flags.String("role", &internal, "");
  ASSERT_EQ(g.Parse({"--role", "target"}).result, Flags::Result::kOk);
  EXPECT_EQ(internal, "target");
}

void ParseOrExit(std::vector<const char*> args) {
  Fixture f;
  args.insert(args.begin(), "prog");
  f.flags.ParseOrExit(static_cast<int>(args.size()), args.data());
  std::exit(3);  // parsed: the caller sees 3
}

TEST(BenchlibFlagsDeathTest, ParseOrExitExitsTwoNamingTheFlag) {
  EXPECT_EXIT(ParseOrExit({"--threds", "3"}), ::testing::ExitedWithCode(2),
              "prog: unknown flag --threds \\(try --help\\)");
  EXPECT_EXIT(ParseOrExit({"--seconds", "x"}), ::testing::ExitedWithCode(2),
              "bad value 'x' for --seconds");
  EXPECT_EXIT(ParseOrExit({"--help"}), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(ParseOrExit({"--threads", "3"}), ::testing::ExitedWithCode(3), "");
}

// ------------------------------------------------------------------------------- JSON

TEST(BenchlibJson, WritesNestedValuesLikePythonsDumps) {
  Json j;
  j.BeginObject()
      .Field("benchmark", "t")
      .Field("quick", true)
      .Field("n", 3)
      .Field("big", uint64_t{18446744073709551615ull})
      .Field("neg", int64_t{-5})
      .Field("gbps", 1.23456, 3)
      .Field("zero", -0.0001, 3)
      .Field("ratio", Ratio(1, 0), 3)
      .Key("short")
      .Number(0.1)
      .Key("twenty")
      .Number(20)
      .Key("none")
      .Null()
      .Key("raw")
      .Raw("{\"a\": 1}")
      .Key("rows")
      .BeginArray()
      .BeginObject()
      .Field("x", 1)
      .EndObject()
      .BeginObject()
      .EndObject()
      .Int(7)
      .EndArray()
      .Key("empty")
      .BeginArray()
      .EndArray()
      .EndObject();
  EXPECT_EQ(j.str(),
            "{\"benchmark\": \"t\", \"quick\": true, \"n\": 3, \"big\": 18446744073709551615, "
            "\"neg\": -5, \"gbps\": 1.235, \"zero\": 0.000, \"ratio\": null, \"short\": 0.1, "
            "\"twenty\": 20, \"none\": null, \"raw\": {\"a\": 1}, \"rows\": [{\"x\": 1}, {}, 7], "
            "\"empty\": []}");
}

TEST(BenchlibJson, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(Json::Escape("plain"), "\"plain\"");
  EXPECT_EQ(Json::Escape("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(Json::Escape("l1\nl2\r\t\b\f"), "\"l1\\nl2\\r\\t\\b\\f\"");
  EXPECT_EQ(Json::Escape(std::string("\x01\x1f", 2)), "\"\\u0001\\u001f\"");
  EXPECT_EQ(Json::Escape(std::string("nul\0x", 5)), "\"nul\\u0000x\"");
  EXPECT_EQ(Json::Escape("µs ≥"), "\"µs ≥\"");  // UTF-8 passes through
  Json j;
  j.BeginObject().Field("we\"ird", "C:\\dir \"x\"").EndObject();
  EXPECT_EQ(j.str(), "{\"we\\\"ird\": \"C:\\\\dir \\\"x\\\"\"}");
  Json n;
  n.Number(std::nan(""));
  EXPECT_EQ(n.str(), "null");
  Json inf;
  inf.Number(1.0 / 0.0, 2);
  EXPECT_EQ(inf.str(), "null");
}

void ValueWhereAKeyIsDue() {
  Json j;
  j.BeginObject().Int(1);
}
void StrOfAnOpenObject() {
  Json j;
  j.BeginObject();
  (void)j.str();
}
void EndObjectInAnArray() {
  Json j;
  j.BeginArray().EndObject();
}
void TwoTopLevelValues() {
  Json j;
  j.Int(1).Int(2);
}

TEST(BenchlibJsonDeathTest, MisuseAborts) {
  EXPECT_DEATH(ValueWhereAKeyIsDue(), "a value where a key is due");
  EXPECT_DEATH(StrOfAnOpenObject(), "open object");
  EXPECT_DEATH(EndObjectInAnArray(), "EndObject without an open object");
  EXPECT_DEATH(TwoTopLevelValues(), "after the top-level value");
}

// SendAll/RecvAll move a buffer larger than the socket's buffers whole; a closed peer is false
// (no SIGPIPE), never a short count taken for success.
TEST(SocketIo, WholeBuffersMoveAndAClosedPeerIsFalse) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  std::vector<char> out(4 << 20), in(out.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 7);
  bool sent = false;
  std::thread writer([&] { sent = SendAll(sv[0], out.data(), out.size()); });
  EXPECT_TRUE(RecvAll(sv[1], in.data(), in.size()));
  writer.join();
  EXPECT_TRUE(sent);
  EXPECT_EQ(in, out);
  close(sv[1]);
  EXPECT_FALSE(SendAll(sv[0], out.data(), out.size())) << "sent to a closed peer";
  EXPECT_FALSE(RecvAll(sv[0], in.data(), 1)) << "read from a closed peer";
  close(sv[0]);
}

}  // namespace
}  // namespace kvbridge::benchlib
