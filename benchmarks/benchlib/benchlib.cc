// benchlib: flags, samples with the nearest-rank percentile, rates and a JSON writer for the
// benchmarks (benchlib.h, docs/benchmarks.md).
#include "benchlib.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

namespace kvbridge::benchlib {

namespace {

// The shortest %g form that reads back as v, without an exponent for ordinary magnitudes
// (20, not 2e+01).
std::string Trimmed(double v) {
  char buf[64];
  const double mag = std::fabs(v);
  const bool plain = mag == 0 || (mag >= 1e-4 && mag < 1e15);
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof(buf), "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v && (!plain || std::strchr(buf, 'e') == nullptr)) break;
  }
  return buf;
}

// Whole string as a signed / unsigned integer; false on anything else (empty, junk, overflow).
bool ParseInt(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = v;
  return true;
}

bool ParseUInt(const std::string& s, uint64_t* out) {
  if (s.empty() || s[0] == '-' || s[0] == '+' || s[0] == ' ') return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = v;
  return true;
}

bool ParseDouble(const std::string& s, double* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

}  // namespace

// ------------------------------------------------------------------------------- flags

Flags::Flags(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

Flags::Flag& Flags::Add(std::string name, Kind kind, void* out, std::string help) {
  if (name.rfind("--", 0) != 0) name = "--" + name;
  for (const Flag& f : flags_) {
    if (f.name == name) {
      std::fprintf(stderr, "benchlib: flag %s registered twice\n", name.c_str());
      std::abort();
    }
  }
  Flag f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.kind = kind;
  f.out = out;
  flags_.push_back(std::move(f));
  return flags_.back();
}

void Flags::Bool(std::string name, bool* out, std::string help) {
  Add(std::move(name), Kind::kBool, out, std::move(help));
}

void Flags::Int(std::string name, int* out, std::string help, int64_t min) {
  Flag& f = Add(std::move(name), Kind::kInt, out, std::move(help));
  f.imin = min;
  f.default_text = std::to_string(*out);
}

void Flags::Int64(std::string name, int64_t* out, std::string help, int64_t min) {
  Flag& f = Add(std::move(name), Kind::kInt64, out, std::move(help));
  f.imin = min;
  f.default_text = std::to_string(*out);
}

void Flags::UInt64(std::string name, uint64_t* out, std::string help, uint64_t min) {
  Flag& f = Add(std::move(name), Kind::kUInt64, out, std::move(help));
  f.umin = min;
  f.default_text = std::to_string(*out);
}

void Flags::Double(std::string name, double* out, std::string help, double min) {
  Flag& f = Add(std::move(name), Kind::kDouble, out, std::move(help));
  f.dmin = min;
  f.default_text = Trimmed(*out);
}

void Flags::String(std::string name, std::string* out, std::string help,
                   std::vector<std::string> choices) {
  Flag& f = Add(std::move(name), Kind::kString, out, std::move(help));
  f.choices = std::move(choices);
  f.default_text = out->empty() ? "" : *out;
}

void Flags::UInt64List(std::string name, std::vector<uint64_t>* out, std::string help,
                       uint64_t unit) {
  Flag& f = Add(std::move(name), Kind::kUInt64List, out, std::move(help));
  f.unit = unit;
  for (uint64_t v : *out) {
    if (!f.default_text.empty()) f.default_text += ",";
    f.default_text += std::to_string(v / unit);
  }
}

void Flags::Repeated(std::string name, std::vector<std::string>* out, std::string help) {
  Add(std::move(name), Kind::kRepeated, out, std::move(help));
}

bool Flags::Set(Flag& f, const std::string& value, std::string* error) {
  auto bad = [&](const std::string& why) {
    *error = "bad value '" + value + "' for " + f.name + ": " + why;
    return false;
  };
  switch (f.kind) {
    case Kind::kBool:
      *static_cast<bool*>(f.out) = true;
      return true;
    case Kind::kInt:
    case Kind::kInt64: {
      int64_t v;
      if (!ParseInt(value, &v)) return bad("not an integer");
      if (f.kind == Kind::kInt &&
          (v > std::numeric_limits<int>::max() || v < std::numeric_limits<int>::min())) {
        return bad("out of range");
      }
      if (v < f.imin) return bad("must be at least " + std::to_string(f.imin));
      if (f.kind == Kind::kInt) {
        *static_cast<int*>(f.out) = static_cast<int>(v);
      } else {
        *static_cast<int64_t*>(f.out) = v;
      }
      return true;
    }
    case Kind::kUInt64: {
      uint64_t v;
      if (!ParseUInt(value, &v)) return bad("not a non-negative integer");
      if (v < f.umin) return bad("must be at least " + std::to_string(f.umin));
      *static_cast<uint64_t*>(f.out) = v;
      return true;
    }
    case Kind::kDouble: {
      double v;
      if (!ParseDouble(value, &v)) return bad("not a number");
      if (v < f.dmin) return bad("must be at least " + Trimmed(f.dmin));
      *static_cast<double*>(f.out) = v;
      return true;
    }
    case Kind::kString:
      if (!f.choices.empty() &&
          std::find(f.choices.begin(), f.choices.end(), value) == f.choices.end()) {
        std::string list;
        for (const std::string& c : f.choices) list += (list.empty() ? "" : ", ") + c;
        return bad("one of " + list);
      }
      *static_cast<std::string*>(f.out) = value;
      return true;
    case Kind::kUInt64List: {
      std::vector<uint64_t> list;
      size_t p = 0;
      while (true) {
        const size_t comma = value.find(',', p);
        const std::string item =
            value.substr(p, comma == std::string::npos ? std::string::npos : comma - p);
        uint64_t v;
        if (!ParseUInt(item, &v)) return bad("'" + item + "' is not a non-negative integer");
        if (f.unit > 1 && v > UINT64_MAX / f.unit) return bad("'" + item + "' is too large");
        list.push_back(v * f.unit);
        if (comma == std::string::npos) break;
        p = comma + 1;
      }
      *static_cast<std::vector<uint64_t>*>(f.out) = std::move(list);
      return true;
    }
    case Kind::kRepeated: {
      auto* out = static_cast<std::vector<std::string>*>(f.out);
      if (!Given(f.name)) out->clear();  // the first use replaces the default
      out->push_back(value);
      return true;
    }
  }
  return false;
}

Flags::Result Flags::Parse(int argc, const char* const* argv, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return Result::kHelp;
    std::string name = arg, value;
    bool inline_value = false;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    auto it =
        std::find_if(flags_.begin(), flags_.end(), [&](const Flag& f) { return f.name == name; });
    if (it == flags_.end()) {
      *error =
          arg.rfind("-", 0) == 0 ? "unknown flag " + name : "unexpected argument '" + arg + "'";
      return Result::kError;
    }
    if (it->kind == Kind::kBool) {
      if (inline_value) {
        *error = name + " takes no value";
        return Result::kError;
      }
    } else if (!inline_value) {
      if (i + 1 >= argc) {
        *error = "missing value for " + name;
        return Result::kError;
      }
      value = argv[++i];
    }
    if (!Set(*it, value, error)) return Result::kError;
    given_.push_back(it->name);
  }
  return Result::kOk;
}

void Flags::ParseOrExit(int argc, const char* const* argv) {
  std::string error;
  switch (Parse(argc, argv, &error)) {
    case Result::kOk:
      return;
    case Result::kHelp:
      std::cout << Usage() << std::flush;
      std::exit(0);
    case Result::kError:
      std::cerr << program_ << ": " << error << " (try --help)\n";
      std::exit(2);
  }
}

bool Flags::Given(std::string_view name) const {
  std::string n(name);
  if (n.rfind("--", 0) != 0) n = "--" + n;
  return std::find(given_.begin(), given_.end(), n) != given_.end();
}

std::string Flags::Usage() const {
  std::string u = "usage: " + program_ + " [flags]\n" + summary_ + "\n\nflags:\n";
  size_t width = 0;
  auto head = [](const Flag& f) {
    switch (f.kind) {
      case Kind::kBool:
        return f.name;
      case Kind::kInt:
      case Kind::kInt64:
      case Kind::kUInt64:
        return f.name + " N";
      case Kind::kDouble:
        return f.name + " X";
      case Kind::kUInt64List:
        return f.name + " N,N,...";
      case Kind::kRepeated:
        return f.name + " VALUE (repeatable)";
      case Kind::kString: {
        if (f.choices.empty()) return f.name + " VALUE";
        std::string c;
        for (const std::string& x : f.choices) c += (c.empty() ? "" : "|") + x;
        return f.name + " " + c;
      }
    }
    return f.name;
  };
  for (const Flag& f : flags_) {
    if (!f.help.empty()) width = std::max(width, head(f).size());
  }
  for (const Flag& f : flags_) {
    if (f.help.empty()) continue;  // internal
    std::string h = head(f);
    u += "  " + h + std::string(width - h.size() + 2, ' ') + f.help;
    if (!f.default_text.empty()) u += " (default " + f.default_text + ")";
    u += "\n";
  }
  u += "  --help" + std::string(width > 6 ? width - 6 + 2 : 2, ' ') + "this list\n";
  return u;
}

// ------------------------------------------------------------------------ samples, stats

void Samples::Merge(const Samples& o) {
  values_.insert(values_.end(), o.values_.begin(), o.values_.end());
  sorted_ = false;
}

double Samples::Percentile(double p) const {
  if (values_.empty()) return std::nan("");
  if (!sorted_) {
    std::sort(values_.begin(), values_.end());
    sorted_ = true;
  }
  const size_t n = values_.size();
  p = std::clamp(p, 0.0, 100.0);
  // Nearest rank: ceil(p/100 * n), at least 1. The 1e-9 keeps a product that binary rounding
  // puts just above a whole number (0.29 * 100 = 29.000000000000004) at that number.
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(n) - 1e-9));
  rank = std::clamp<size_t>(rank, 1, n);
  return values_[rank - 1];
}

double Samples::Mean() const {
  if (values_.empty()) return std::nan("");
  double sum = 0;
  for (double v : values_) sum += v;
  return sum / static_cast<double>(values_.size());
}

double Percentile(std::vector<double> v, double p) {
  Samples s;
  for (double x : v) s.Add(x);
  return s.Percentile(p);
}

Summary Summarize(const Samples& s) {
  Summary r;
  r.count = s.count();
  r.min = s.Min();
  r.mean = s.Mean();
  r.p50 = s.Percentile(50);
  r.p99 = s.Percentile(99);
  r.max = s.Max();
  return r;
}

// ------------------------------------------------------------------------------ rates

double Gbps(double bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0; }

double Ratio(double value, double baseline) {
  if (!(baseline > 0) || std::isnan(value)) return std::nan("");
  return value / baseline;
}

// ------------------------------------------------------------------------------- JSON

namespace {
[[noreturn]] void Misuse(const char* what) {
  std::fprintf(stderr, "benchlib::Json misuse: %s\n", what);
  std::abort();
}
}  // namespace

std::string Json::Escape(std::string_view s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        o += "\\\"";
        break;
      case '\\':
        o += "\\\\";
        break;
      case '\n':
        o += "\\n";
        break;
      case '\r':
        o += "\\r";
        break;
      case '\t':
        o += "\\t";
        break;
      case '\b':
        o += "\\b";
        break;
      case '\f':
        o += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          o += buf;
        } else {
          o.push_back(static_cast<char>(c));  // UTF-8 passes through
        }
    }
  }
  o += "\"";
  return o;
}

void Json::BeforeValue() {
  if (done_) Misuse("a value after the top-level value");
  if (stack_.empty()) {
    done_ = true;  // the top-level value; containers reset it until their end
    return;
  }
  char& top = stack_.back();
  if (top == 'o') Misuse("a value where a key is due");
  if (top == 'v') {
    top = 'o';
    return;
  }
  if (!first_.back()) out_ += ", ";
  first_.back() = false;
}

Json& Json::BeginObject() {
  BeforeValue();
  out_ += "{";
  stack_.push_back('o');
  first_.push_back(true);
  done_ = false;
  return *this;
}

Json& Json::EndObject() {
  if (stack_.empty() || stack_.back() != 'o') Misuse("EndObject without an open object");
  out_ += "}";
  stack_.pop_back();
  first_.pop_back();
  done_ = stack_.empty();
  return *this;
}

Json& Json::BeginArray() {
  BeforeValue();
  out_ += "[";
  stack_.push_back('a');
  first_.push_back(true);
  done_ = false;
  return *this;
}

Json& Json::EndArray() {
  if (stack_.empty() || stack_.back() != 'a') Misuse("EndArray without an open array");
  out_ += "]";
  stack_.pop_back();
  first_.pop_back();
  done_ = stack_.empty();
  return *this;
}

Json& Json::Key(std::string_view k) {
  if (stack_.empty() || stack_.back() != 'o') Misuse("a key outside an object");
  if (!first_.back()) out_ += ", ";
  first_.back() = false;
  out_ += Escape(k);
  out_ += ": ";
  stack_.back() = 'v';
  return *this;
}

Json& Json::String(std::string_view s) {
  BeforeValue();
  out_ += Escape(s);
  return *this;
}

Json& Json::Bool(bool b) {
  BeforeValue();
  out_ += b ? "true" : "false";
  return *this;
}

Json& Json::Null() {
  BeforeValue();
  out_ += "null";
  return *this;
}

Json& Json::Int(int64_t v) {
  BeforeValue();
  out_ += std::to_string(v);
  return *this;
}

Json& Json::UInt(uint64_t v) {
  BeforeValue();
  out_ += std::to_string(v);
  return *this;
}

Json& Json::Number(double v, int decimals) {
  BeforeValue();
  if (!std::isfinite(v)) {
    out_ += "null";
  } else if (decimals >= 0) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
    // "-0.000" reads as 0 but looks odd
    out_ += std::strtod(buf, nullptr) == 0 ? std::string(buf + (buf[0] == '-' ? 1 : 0)) : buf;
  } else {
    out_ += Trimmed(v);
  }
  return *this;
}

Json& Json::Raw(std::string_view json) {
  BeforeValue();
  out_ += json;
  return *this;
}

const std::string& Json::str() const {
  if (!stack_.empty()) Misuse("str() with an open object or array");
  return out_;
}

bool SendAll(int fd, const void* p, size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool RecvAll(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = recv(fd, c, n, 0);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

void PrintResult(const Json& json) {
  std::fflush(stderr);
  std::cout << json.str() << std::endl;
}

}  // namespace kvbridge::benchlib
