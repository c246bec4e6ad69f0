#include "store/key_pattern.h"

#include <regex>
#include <utility>

namespace kvbridge::store {

struct KeyPattern::Compiled {
  std::regex re;
};

KeyPattern::KeyPattern(std::string pattern, std::unique_ptr<Compiled> compiled)
    : pattern_(std::move(pattern)), compiled_(std::move(compiled)) {}
KeyPattern::KeyPattern(KeyPattern&&) noexcept = default;
KeyPattern& KeyPattern::operator=(KeyPattern&&) noexcept = default;
KeyPattern::~KeyPattern() = default;

Result<KeyPattern> KeyPattern::Compile(std::string_view pattern) {
  if (pattern.empty()) {
    return Status::InvalidArgument(
        "the key pattern is empty (it would match every key: RemoveAll removes everything)");
  }
  auto compiled = std::make_unique<Compiled>();
  try {
    compiled->re = std::regex(pattern.begin(), pattern.end(), std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return Status::InvalidArgument("the key pattern '" + std::string(pattern) +
                                   "' is not a valid regular expression: " + e.what());
  }
  return KeyPattern(std::string(pattern), std::move(compiled));
}

bool KeyPattern::Matches(std::string_view key) const {
  try {
    return std::regex_search(key.begin(), key.end(), compiled_->re);
  } catch (const std::regex_error&) {
    return false;  // error_complexity / error_stack: the engine gave up
  }
}

}  // namespace kvbridge::store
