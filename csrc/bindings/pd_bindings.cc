// kvbridge._C.PdSideChannel: the prefill side of the vLLM connector's side channel
// (python/kvbridge/integrations/_vllm_pd.py, docs/vllm.md), served natively.
//
// A decode asks `hello` (the prefill's descriptor, identity and KV layout: a fixed answer
// built by Python at start) and sends `release` when it is done with a request's blocks. Both
// are answered on a core::RequestServer thread that never takes the GIL: a prefill worker
// whose Python threads are busy (vLLM's main loop spinning on its message queue with the GIL
// held, under CPU pressure) still answers at once. The worker's own calls (hold,
// take_finished) take a mutex for microseconds.
//
// Wire (both directions): a 4-byte big-endian length, then a JSON object. Requests:
//   {"op": "hello"}
//   {"op": "release", "request_id": "<id>", "incarnation": "0x<16 hex digits>"}
// Answers: the hello object; {"held": true|false} (plus "stale": true for a release naming
// another incarnation); {"error": "...", "code": "PROTOCOL"|"INVALID_ARGUMENT"} for a bad one.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "core/handshake.h"

namespace kvbridge::bindings {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMaxRequestBytes = 64 << 10;        // a release is well under 1 KiB
constexpr auto kReportedKeep = std::chrono::hours(1);  // freed ids remembered (late releases)
constexpr size_t kMaxEarly = 65536;  // releases of ids not (yet) held, remembered at once

// JSON string body (without quotes) for `s`; bytes >= 0x80 pass through (UTF-8).
std::string JsonEscape(std::string_view s) {
  std::string out;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      static const char* hex = "0123456789abcdef";
      out += "\\u00";
      out += hex[u >> 4];
      out += hex[u & 15];
    } else {
      out += c;
    }
  }
  return out;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | (cp >> 6));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | (cp >> 12));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | (cp >> 18));
    *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// A minimal reader of what the decode sends: one flat JSON object. String values are kept
// (escapes decoded); numbers, true, false and null are accepted and skipped; nested values
// and anything else make it malformed. Returns "" or what was wrong.
class FlatJson {
 public:
  explicit FlatJson(std::string_view s) : s_(s) {}

  std::string Parse(std::map<std::string, std::string>* out) {
    Space();
    if (!Eat('{')) return "expected an object";
    Space();
    if (Eat('}')) return End();
    for (;;) {
      std::string key, value;
      Space();
      if (!String(&key)) return "expected a string key";
      Space();
      if (!Eat(':')) return "expected ':' after \"" + JsonEscape(key) + "\"";
      Space();
      if (Peek() == '"') {
        if (!String(&value)) return "bad string value of \"" + JsonEscape(key) + "\"";
        (*out)[key] = std::move(value);
      } else if (!Scalar()) {
        return "value of \"" + JsonEscape(key) + "\" is not a string, number or literal";
      }
      Space();
      if (Eat('}')) return End();
      if (!Eat(',')) return "expected ',' or '}'";
    }
  }

 private:
  char Peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  bool Eat(char c) {
    if (Peek() != c || i_ >= s_.size()) return false;
    ++i_;
    return true;
  }
  void Space() {
    while (i_ < s_.size() &&
           (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) {
      ++i_;
    }
  }
  std::string End() {
    Space();
    return i_ == s_.size() ? std::string() : "trailing bytes after the object";
  }
  bool Hex4(uint32_t* v) {
    if (i_ + 4 > s_.size()) return false;
    *v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      *v <<= 4;
      if (c >= '0' && c <= '9')
        *v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        *v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        *v |= c - 'A' + 10;
      else
        return false;
    }
    return true;
  }
  bool String(std::string* out) {
    if (!Eat('"')) return false;
    while (i_ < s_.size()) {
      const char c = s_[i_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c != '\\') {
        *out += c;
        continue;
      }
      if (i_ >= s_.size()) return false;
      const char e = s_[i_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          *out += e;
          break;
        case 'b':
          *out += '\b';
          break;
        case 'f':
          *out += '\f';
          break;
        case 'n':
          *out += '\n';
          break;
        case 'r':
          *out += '\r';
          break;
        case 't':
          *out += '\t';
          break;
        case 'u': {
          uint32_t cp = 0;
          if (!Hex4(&cp)) return false;
          if (cp >= 0xD800 && cp < 0xDC00) {  // a surrogate pair
            uint32_t lo = 0;
            if (!Eat('\\') || !Eat('u') || !Hex4(&lo) || lo < 0xDC00 || lo >= 0xE000) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            return false;
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          return false;
      }
    }
    return false;
  }
  bool Scalar() {
    for (const std::string_view lit : {"true", "false", "null"}) {
      if (s_.substr(i_, lit.size()) == lit) {
        i_ += lit.size();
        return true;
      }
    }
    const size_t start = i_;
    while (i_ < s_.size() &&
           std::string_view("+-.eE0123456789").find(s_[i_]) != std::string_view::npos) {
      ++i_;
    }
    return i_ > start;
  }

  std::string_view s_;
  size_t i_ = 0;
};

std::string Frame(const std::string& json) {
  const auto n = static_cast<uint32_t>(json.size());
  std::string out{static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8),
                  static_cast<char>(n)};
  return out + json;
}

std::string Error(const std::string& code, const std::string& why) {
  return Frame("{\"error\": \"" + JsonEscape(why) + "\", \"code\": \"" + code + "\"}");
}

// The requests a prefill holds blocks for, and what happened to them. Mirrors the rules in
// docs/vllm.md: a request's blocks stay allocated until take_finished() returns its id (a
// decode released it, or its hold ran out); a release that comes before the worker learnt
// the hold is remembered, and answered held (the scheduler keeps the blocks until the worker
// reports the id, which it does only after learning the hold).
class Holds {
 public:
  Holds(std::string hello, std::string incarnation)
      : hello_(Frame(hello)), incarnation_(std::move(incarnation)) {}

  core::RequestServer::Answer Answer(std::string_view in) {
    core::RequestServer::Answer a;
    if (in.size() < 4) return a;  // kMore
    const uint32_t n = (static_cast<uint32_t>(static_cast<unsigned char>(in[0])) << 24) |
                       (static_cast<uint32_t>(static_cast<unsigned char>(in[1])) << 16) |
                       (static_cast<uint32_t>(static_cast<unsigned char>(in[2])) << 8) |
                       static_cast<uint32_t>(static_cast<unsigned char>(in[3]));
    a.kind = core::RequestServer::Answer::kReply;
    if (n > kMaxRequestBytes - 4) {
      a.out = Error("PROTOCOL", "request of " + std::to_string(n) + " bytes (at most " +
                                    std::to_string(kMaxRequestBytes - 4) + ")");
      return a;
    }
    if (in.size() < 4 + size_t{n}) {
      a.kind = core::RequestServer::Answer::kMore;
      return a;
    }
    if (in.size() > 4 + size_t{n}) {
      a.out = Error("PROTOCOL", "bytes after the request");
      return a;
    }
    std::map<std::string, std::string> msg;
    const std::string bad = FlatJson(in.substr(4)).Parse(&msg);
    if (!bad.empty()) {
      a.out = Error("PROTOCOL", "malformed request: " + bad);
      return a;
    }
    const std::string& op = msg["op"];
    if (op == "hello") {
      a.out = hello_;
    } else if (op == "release") {
      a.out = Release(msg);
    } else {
      a.out = Error("INVALID_ARGUMENT", "unknown op \"" + op + "\"");
    }
    return a;
  }

  void Hold(const std::vector<std::pair<std::string, double>>& requests) {
    const auto now = Clock::now();
    std::lock_guard lock(mu_);
    for (const auto& [rid, seconds] : requests) {
      if (early_.erase(rid) > 0) {
        finished_.insert(rid);
        ++released_;
      } else {
        held_[rid] = now + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(seconds));
      }
    }
  }

  // Ids whose blocks may be freed now (released or expired), each returned once; and the
  // releases and expiries counted since the last call.
  std::tuple<std::vector<std::string>, uint64_t, uint64_t> TakeFinished() {
    const auto now = Clock::now();
    std::lock_guard lock(mu_);
    for (auto it = held_.begin(); it != held_.end();) {
      if (now >= it->second) {
        finished_.insert(it->first);
        ++expired_;
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
    std::vector<std::string> done(finished_.begin(), finished_.end());
    finished_.clear();
    for (const auto& rid : done) {
      if (reported_.insert(rid).second) reported_order_.emplace_back(now, rid);
    }
    while (!reported_order_.empty() && reported_order_.front().first < now - kReportedKeep) {
      reported_.erase(reported_order_.front().second);
      reported_order_.pop_front();
    }
    while (!early_order_.empty() &&
           (early_order_.front().first < now - kReportedKeep || early_order_.size() > kMaxEarly)) {
      auto it = early_.find(early_order_.front().second);
      if (it != early_.end() && it->second == early_order_.front().first) early_.erase(it);
      early_order_.pop_front();
    }
    auto out =
        std::make_tuple(std::move(done), released_ - released_seen_, expired_ - expired_seen_);
    released_seen_ = released_;
    expired_seen_ = expired_;
    return out;
  }

  size_t NumHeld() {
    std::lock_guard lock(mu_);
    return held_.size();
  }

 private:
  std::string Release(const std::map<std::string, std::string>& msg) {
    const auto rid = msg.find("request_id");
    if (rid == msg.end()) return Error("INVALID_ARGUMENT", "release: request_id missing");
    const auto inc = msg.find("incarnation");
    if (inc == msg.end() || inc->second != incarnation_) {
      return Frame("{\"held\": false, \"stale\": true}");
    }
    const std::string& id = rid->second;
    std::lock_guard lock(mu_);
    if (held_.erase(id) > 0) {
      finished_.insert(id);
      ++released_;
      return Frame("{\"held\": true}");
    }
    if (reported_.count(id) > 0 || finished_.count(id) > 0) return Frame("{\"held\": false}");
    // Not yet known: the scheduler holds the blocks until the worker reports the id, which it
    // does only after learning the hold, so they are still intact. Bounded: past kMaxEarly the
    // oldest are forgotten at the next take_finished (their holds then run out instead).
    const auto now = Clock::now();
    early_[id] = now;
    early_order_.emplace_back(now, id);
    return Frame("{\"held\": true}");
  }

  const std::string hello_;  // framed
  const std::string incarnation_;
  std::mutex mu_;
  std::unordered_map<std::string, Clock::time_point> held_;   // id -> end of its hold
  std::unordered_map<std::string, Clock::time_point> early_;  // released before the hold
  std::deque<std::pair<Clock::time_point, std::string>> early_order_;
  std::unordered_set<std::string> finished_;
  std::unordered_set<std::string> reported_;
  std::deque<std::pair<Clock::time_point, std::string>> reported_order_;
  uint64_t released_ = 0, expired_ = 0, released_seen_ = 0, expired_seen_ = 0;
};

class PdSideChannel {
 public:
  PdSideChannel(const std::string& listen, std::string hello, std::string incarnation)
      : holds_(std::make_shared<Holds>(std::move(hello), std::move(incarnation))) {
    core::RequestServer::Limits limits;
    limits.max_request_bytes = kMaxRequestBytes;
    limits.exchange_timeout_ms = 2000;
    limits.max_open = 1024;  // decodes on one host share one address: room for all of them
    limits.max_per_source = 512;
    auto holds = holds_;
    server_ = Unwrap(core::RequestServer::Start(
        listen, "side channel", [holds](std::string_view in) { return holds->Answer(in); },
        limits));
  }
  Holds& holds() { return *holds_; }
  const std::string& endpoint() const { return server_->address(); }
  uint64_t served() const { return server_->served(); }
  uint64_t rejected() const { return server_->rejected(); }

 private:
  std::shared_ptr<Holds> holds_;
  std::unique_ptr<core::RequestServer> server_;
};

using PdHandle = Handle<PdSideChannel>;

}  // namespace

void BindPd(py::module_& m) {
  py::class_<PdHandle, std::shared_ptr<PdHandle>>(
      m, "PdSideChannel",
      "The prefill side of the vLLM connector's side channel, answered on a native thread "
      "(no GIL): hello and release (python/kvbridge/integrations/_vllm_pd.py).")
      .def(py::init([](const std::string& listen, const std::string& hello,
                       const std::string& incarnation) {
             return NoGil([&] {
               return std::make_shared<PdHandle>(
                   std::make_unique<PdSideChannel>(listen, hello, incarnation), "side channel");
             });
           }),
           py::arg("listen"), py::arg("hello"), py::arg("incarnation"))
      .def_property_readonly(
          "endpoint",
          [](PdHandle& h) {
            return NoGil([&] { return h.With([](PdSideChannel& s) { return s.endpoint(); }); });
          })
      .def("hold",
           [](PdHandle& h, const std::vector<std::pair<std::string, double>>& requests) {
             NoGil([&] { h.With([&](PdSideChannel& s) { s.holds().Hold(requests); }); });
           })
      .def("take_finished",
           [](PdHandle& h) {
             return NoGil(
                 [&] { return h.With([](PdSideChannel& s) { return s.holds().TakeFinished(); }); });
           })
      .def_property_readonly(
          "num_held",
          [](PdHandle& h) {
            return NoGil(
                [&] { return h.With([](PdSideChannel& s) { return s.holds().NumHeld(); }); });
          })
      .def("stats",
           [](PdHandle& h) {
             auto [served, rejected] = NoGil([&] {
               return h.With(
                   [](PdSideChannel& s) { return std::make_pair(s.served(), s.rejected()); });
             });
             py::dict d;
             d["served"] = served;
             d["rejected"] = rejected;
             return d;
           })
      .def("close", [](PdHandle& h) { NoGil([&] { h.Close(); }); });
}

}  // namespace kvbridge::bindings
