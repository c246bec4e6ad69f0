// The one logger: KVB_LOG(INFO) << "text"; writes one line to stderr as
//   "I 16:05:01.123 kvbridge] text"
// Level threshold from KVBRIDGE_LOG_LEVEL (debug|info|warn|error; default warn), read once.
// Thread-safe: each statement is formatted locally and written with one write(2).
#pragma once

#include <sstream>
#include <string_view>

namespace kvbridge::util {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

LogLevel LogThreshold();
bool LogEnabled(LogLevel level);
// Writes one line; `component` is e.g. "kvbridge" or a plugin name.
void LogLine(LogLevel level, std::string_view component, std::string_view msg);

class LogMessage {
 public:
  LogMessage(LogLevel level, std::string_view component) : level_(level), component_(component) {}
  ~LogMessage() { LogLine(level_, component_, stream_.str()); }
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::string_view component_;
  std::ostringstream stream_;
};

}  // namespace kvbridge::util

#define KVB_LOG_LEVEL_DEBUG ::kvbridge::util::LogLevel::kDebug
#define KVB_LOG_LEVEL_INFO ::kvbridge::util::LogLevel::kInfo
#define KVB_LOG_LEVEL_WARN ::kvbridge::util::LogLevel::kWarn
#define KVB_LOG_LEVEL_ERROR ::kvbridge::util::LogLevel::kError

// Turns the streamed expression into void so it can sit in a conditional expression; `&` binds
// looser than `<<`, so the whole message is built first. (No if/else: a KVB_LOG inside an
// unbraced if must not capture a following else.)
namespace kvbridge::util {
struct LogVoidify {
  void operator&(std::ostream&) {}
};
}  // namespace kvbridge::util

#define KVB_LOG(level)                                 \
  !::kvbridge::util::LogEnabled(KVB_LOG_LEVEL_##level) \
      ? (void)0                                        \
      : ::kvbridge::util::LogVoidify() &               \
            ::kvbridge::util::LogMessage(KVB_LOG_LEVEL_##level, "kvbridge").stream()
