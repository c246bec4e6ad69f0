// The one reader of KVBRIDGE_* environment variables into option fields, used by every
// Options::FromEnv(). Each function leaves *out as it was when the variable is unset; a value
// that does not parse also leaves it, with a warning naming the variable, the value and what
// was expected (a typo in a deployment's environment must show, not silently become a default
// or a truncated number). Stateless and thread-safe as far as getenv(3) is.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvbridge::util {

void EnvString(const char* var, std::string* out);
// Decimal digits only, within the type's range.
void EnvNumber(const char* var, uint32_t* out);
void EnvNumber(const char* var, uint64_t* out);
// A decimal number as strtod(3) reads it ("0.9", "1e-3").
void EnvNumber(const char* var, double* out);
// 1/true/on or 0/false/off.
void EnvBool(const char* var, bool* out);
// Comma-separated, empty items dropped ("tcp,ucx"); replaces *out when set.
void EnvList(const char* var, std::vector<std::string>* out);

}  // namespace kvbridge::util
