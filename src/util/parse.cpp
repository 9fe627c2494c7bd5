// Copyright mstar-kv authors.
#include "util/parse.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::util {

namespace {

[[noreturn]] void bad(std::string_view what, std::string_view text, const std::string& range) {
  throw Error(StatusCode::kInvalidArgument,
              std::string(what) + " wants " + range + ", got '" + std::string(text) + "'");
}

}  // namespace

std::uint64_t parse_u64(std::string_view text, std::string_view what, std::uint64_t lo,
                        std::uint64_t hi) {
  const std::string range =
      "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  int base = 10;
  std::string_view digits = text;
  if (digits.size() > 2 && digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'X')) {
    base = 16;
    digits.remove_prefix(2);
  }
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v, base);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() || v < lo ||
      v > hi) {
    bad(what, text, range);
  }
  return v;
}

double parse_f64(std::string_view text, std::string_view what, double lo, double hi) {
  const std::string s(text);
  const std::string range = "a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) bad(what, text, range);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(v) || v < lo || v > hi) {
    bad(what, text, range);
  }
  return v;
}

}  // namespace mstar::kv::util
