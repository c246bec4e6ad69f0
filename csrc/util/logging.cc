#include "util/logging.h"

#include <strings.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

namespace kvbridge::util {

LogLevel LogThreshold() {
  static const LogLevel level = [] {
    const char* v = std::getenv("KVBRIDGE_LOG_LEVEL");
    if (v == nullptr) return LogLevel::kWarn;
    if (strcasecmp(v, "debug") == 0) return LogLevel::kDebug;
    if (strcasecmp(v, "info") == 0) return LogLevel::kInfo;
    if (strcasecmp(v, "error") == 0) return LogLevel::kError;
    return LogLevel::kWarn;
  }();
  return level;
}

bool LogEnabled(LogLevel level) { return level >= LogThreshold(); }

void LogLine(LogLevel level, std::string_view component, std::string_view msg) {
  static const char kLetters[] = {'D', 'I', 'W', 'E'};
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm tm;
  localtime_r(&tv.tv_sec, &tm);
  char prefix[64];
  int n = std::snprintf(prefix, sizeof(prefix), "%c %02d:%02d:%02d.%03d %.*s] ",
                        kLetters[static_cast<int>(level)], tm.tm_hour, tm.tm_min, tm.tm_sec,
                        static_cast<int>(tv.tv_usec / 1000), static_cast<int>(component.size()),
                        component.data());
  std::string line(prefix, n > 0 ? static_cast<size_t>(n) : 0);
  line.append(msg);
  line.push_back('\n');
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace kvbridge::util
