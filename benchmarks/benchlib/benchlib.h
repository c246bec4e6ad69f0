// benchlib: what every C++ benchmark in benchmarks/ shares (docs/benchmarks.md).
//
//   Flags    typed command-line flags with defaults; --help lists them; an unknown flag, a
//            missing value or a bad value is named on stderr and the program exits 2.
//   Samples  a set of latency (or any) samples with the ONE percentile rule of the project:
//            nearest rank. Percentile(p) is the smallest sample x such that at least p% of the
//            samples are <= x, i.e. the sorted sample at rank ceil(p/100 * n) (1-based), with
//            rank 1 for p = 0. So p0 is the minimum, p100 the maximum, p50 of an odd count the
//            middle sample and of an even count the lower of the two middle ones. No samples:
//            NaN, which the JSON writer prints as null.
//   Gbps     throughput in GB/s, 1 GB = 1e9 bytes.
//   Ratio    value / baseline, NaN (null in JSON) when the baseline is not a positive number.
//   SendAll/RecvAll  a whole buffer over a stream socket; false on error or a closed peer.
//   Json     a small JSON writer for the result line (the last stdout line, one object).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace kvbridge::benchlib {

// ------------------------------------------------------------------------------- flags

class Flags {
 public:
  // `program` names the program in messages; `summary` is the first line of --help.
  Flags(std::string program, std::string summary);

  // Each call registers --name, writing into *out (which holds the default). `help` may be
  // empty for a flag meant for the program itself (e.g. a re-executed child's role): it is
  // accepted but not listed.
  void Bool(std::string name, bool* out, std::string help);  // --name sets true
  void Int(std::string name, int* out, std::string help,
           int64_t min = std::numeric_limits<int>::min());
  void Int64(std::string name, int64_t* out, std::string help,
             int64_t min = std::numeric_limits<int64_t>::min());
  void UInt64(std::string name, uint64_t* out, std::string help, uint64_t min = 0);
  void Double(std::string name, double* out, std::string help, double min = -1e300);
  // `choices`, when not empty, are the only values accepted.
  void String(std::string name, std::string* out, std::string help,
              std::vector<std::string> choices = {});
  // Comma-separated non-negative integers, each multiplied by `unit` (e.g. 1024 for KiB).
  void UInt64List(std::string name, std::vector<uint64_t>* out, std::string help,
                  uint64_t unit = 1);
  // May be given many times; each value is appended (the default list is replaced by the first).
  void Repeated(std::string name, std::vector<std::string>* out, std::string help);

  enum class Result { kOk, kHelp, kError };
  // Parses argv[1..]: "--name value", "--name=value", "--bool". On kError, *error says what was
  // wrong (naming the flag); on kHelp, Usage() is what to print. Flags are written as parsed.
  Result Parse(int argc, const char* const* argv, std::string* error);
  // Parse, then: --help prints Usage() to stdout and exits 0; an error prints
  // "<program>: <error> (try --help)" to stderr and exits 2.
  void ParseOrExit(int argc, const char* const* argv);
  // Whether --name was on the command line (to apply --quick's defaults only to what is unset).
  bool Given(std::string_view name) const;
  std::string Usage() const;

 private:
  enum class Kind { kBool, kInt, kInt64, kUInt64, kDouble, kString, kUInt64List, kRepeated };
  struct Flag {
    std::string name, help, default_text;
    Kind kind;
    void* out;
    int64_t imin = 0;
    uint64_t umin = 0;
    double dmin = 0;
    uint64_t unit = 1;
    std::vector<std::string> choices;
  };
  Flag& Add(std::string name, Kind kind, void* out, std::string help);
  bool Set(Flag& f, const std::string& value, std::string* error);
  std::string program_, summary_;
  std::vector<Flag> flags_;
  std::vector<std::string> given_;
};

// ------------------------------------------------------------------------ samples, stats

// Sorted lazily on the first query after an Add: not for queries from several threads at once.
class Samples {
 public:
  void Add(double v) {
    values_.push_back(v);
    sorted_ = false;
  }
  void Merge(const Samples& o);
  void Reserve(size_t n) { values_.reserve(n); }
  size_t count() const { return values_.size(); }
  bool empty() const { return values_.empty(); }

  // Nearest rank (header comment); p in [0, 100], clamped. NaN when empty.
  double Percentile(double p) const;
  double Median() const { return Percentile(50); }
  double Min() const { return Percentile(0); }
  double Max() const { return Percentile(100); }
  double Mean() const;  // NaN when empty

 private:
  mutable std::vector<double> values_;
  mutable bool sorted_ = true;
};

// The nearest-rank percentile of `v` (need not be sorted); NaN when empty.
double Percentile(std::vector<double> v, double p);

struct Summary {
  size_t count = 0;
  double min = 0, mean = 0, p50 = 0, p99 = 0, max = 0;  // NaN when count == 0
};
Summary Summarize(const Samples& s);

// ------------------------------------------------------------------------------ rates

// GB/s for `bytes` moved in `seconds` (1 GB = 1e9 B); 0 when seconds <= 0.
double Gbps(double bytes, double seconds);
// value / baseline; NaN (null in JSON) when the baseline is not > 0 or either is NaN.
double Ratio(double value, double baseline);

// ------------------------------------------------------------------------------ sockets

// Blocking send/recv of exactly n bytes on a connected stream socket (a benchmark's own
// connections: raw-socket baselines, a child's descriptor); false on error or a closed peer.
// send uses MSG_NOSIGNAL, so a closed peer is an error, not a SIGPIPE.
bool SendAll(int fd, const void* p, size_t n);
bool RecvAll(int fd, void* p, size_t n);

// ------------------------------------------------------------------------------- JSON

// Writes one JSON text, compact with ", " and ": " separators (as Python's json.dumps does).
// Non-finite numbers are written as null. Misuse (a value where a key is due, unbalanced
// ends) is a programming error and aborts.
class Json {
 public:
  Json& BeginObject();
  Json& EndObject();
  Json& BeginArray();
  Json& EndArray();
  Json& Key(std::string_view k);
  Json& String(std::string_view s);
  Json& Bool(bool b);
  Json& Null();
  Json& Int(int64_t v);
  Json& UInt(uint64_t v);
  // `decimals` >= 0: fixed with that many decimals; < 0: shortest form that reads back the same.
  Json& Number(double v, int decimals = -1);
  Json& Raw(std::string_view json);  // an already-rendered JSON value

  // Key + value shorthands.
  Json& Field(std::string_view k, std::string_view s) { return Key(k).String(s); }
  Json& Field(std::string_view k, const char* s) { return Key(k).String(s); }
  Json& Field(std::string_view k, const std::string& s) { return Key(k).String(s); }
  Json& Field(std::string_view k, bool b) { return Key(k).Bool(b); }
  Json& Field(std::string_view k, int v) { return Key(k).Int(v); }
  Json& Field(std::string_view k, int64_t v) { return Key(k).Int(v); }
  Json& Field(std::string_view k, uint64_t v) { return Key(k).UInt(v); }
  Json& Field(std::string_view k, uint32_t v) { return Key(k).UInt(v); }
  Json& Field(std::string_view k, double v, int decimals) { return Key(k).Number(v, decimals); }

  // The text; aborts unless every object and array is closed.
  const std::string& str() const;

  static std::string Escape(std::string_view s);  // the quoted JSON string for s

 private:
  void BeforeValue();
  std::string out_;
  // One entry per open container: 'o' object expecting a key, 'v' object expecting the value
  // after a key, 'a' array; `first_` says whether the container has no member yet.
  std::string stack_;
  std::vector<bool> first_;
  bool done_ = false;
};

// Prints `json` as the last stdout line (newline, flushed). The contract of every benchmark:
// the last stdout line is one JSON object; progress goes to stderr.
void PrintResult(const Json& json);

}  // namespace kvbridge::benchlib
