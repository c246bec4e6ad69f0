// KeyPattern: a regular expression over object keys, for MasterState::RemoveByRegex and the
// client's forgetting of what such a removal took. ECMAScript syntax (std::regex), matched
// anywhere in the key (std::regex_search), as Mooncake's remove_by_regex matches: "a3" matches
// "req/a3", "^req/" only keys that start with it. <regex> stays in key_pattern.cc.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "kvbridge/status.h"

namespace kvbridge::store {

class KeyPattern {
 public:
  // INVALID_ARGUMENT for an empty pattern (removing everything is RemoveAll, asked for by
  // name) or one std::regex cannot compile, naming the pattern and what is wrong with it.
  static Result<KeyPattern> Compile(std::string_view pattern);
  KeyPattern(KeyPattern&&) noexcept;
  KeyPattern& operator=(KeyPattern&&) noexcept;
  ~KeyPattern();

  // True if the pattern matches somewhere in key. A match the regex engine gives up on (its
  // complexity or stack limit on a pathological pattern) is no match.
  bool Matches(std::string_view key) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Compiled;
  KeyPattern(std::string pattern, std::unique_ptr<Compiled> compiled);
  std::string pattern_;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace kvbridge::store
