// Internal helpers shared by the kernel library's C entry points: writing the caller's error
// buffer and returning a status in one statement.
#ifndef KVBRIDGE_KERNELS_COMMON_ERROR_H_
#define KVBRIDGE_KERNELS_COMMON_ERROR_H_

#include <cstdarg>
#include <cstddef>
#include <cstdio>

namespace kvb_kernels {

// Formats into err (when it is usable) and returns status, so callers write
// `return Fail(err, len, KVB_KERNEL_ERR_INVALID_ARGUMENT, "...", ...);`.
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
inline int
Fail(char* err, size_t err_len, int status, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
  }
  return status;
}

}  // namespace kvb_kernels

#endif  // KVBRIDGE_KERNELS_COMMON_ERROR_H_
