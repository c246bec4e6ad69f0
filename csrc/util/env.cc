#include "util/env.h"

#include <charconv>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "util/logging.h"

namespace kvbridge::util {
namespace {

void Ignore(const char* var, std::string_view value, const char* expected) {
  KVB_LOG(WARN) << "ignoring " << var << "='" << value << "': not " << expected;
}

template <typename T>
void EnvUnsigned(const char* var, T* out, const char* expected) {
  const char* v = std::getenv(var);
  if (v == nullptr) return;
  std::string_view s(v);
  T value{};
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size()) {
    Ignore(var, s, expected);
    return;
  }
  *out = value;
}

}  // namespace

void EnvString(const char* var, std::string* out) {
  if (const char* v = std::getenv(var)) *out = v;
}

void EnvNumber(const char* var, uint32_t* out) {
  EnvUnsigned(var, out, "an unsigned 32-bit number");
}

void EnvNumber(const char* var, uint64_t* out) {
  EnvUnsigned(var, out, "an unsigned 64-bit number");
}

void EnvNumber(const char* var, double* out) {
  const char* v = std::getenv(var);
  if (v == nullptr) return;
  char* end = nullptr;
  const double d = std::strtod(v, &end);
  if (end == v || *end != '\0') {
    Ignore(var, v, "a number");
    return;
  }
  *out = d;
}

void EnvBool(const char* var, bool* out) {
  const char* v = std::getenv(var);
  if (v == nullptr) return;
  std::string_view s(v);
  if (s == "1" || s == "true" || s == "on") {
    *out = true;
  } else if (s == "0" || s == "false" || s == "off") {
    *out = false;
  } else {
    Ignore(var, s, "0/1, true/false or on/off");
  }
}

void EnvList(const char* var, std::vector<std::string>* out) {
  const char* v = std::getenv(var);
  if (v == nullptr) return;
  std::vector<std::string> items;
  std::string_view s(v);
  while (!s.empty()) {
    const size_t comma = s.find(',');
    std::string_view item = s.substr(0, comma);
    if (!item.empty()) items.emplace_back(item);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  *out = std::move(items);
}

}  // namespace kvbridge::util
