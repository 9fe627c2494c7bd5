// Copyright mstar-kv authors.
//
// Names of small enums, held in one table per enum so that printing a value
// and parsing a name cannot drift apart. The tables are indexed by the
// enum's value, so the enum must number its values 0..N-1; each table's user
// checks that with a static_assert on its last value.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace mstar::kv {

// The name of `value`, or `fallback` for a value outside the table (a byte
// decoded from untrusted input, say).
template <typename E, std::size_t N>
constexpr std::string_view enum_name(E value, const std::array<std::string_view, N>& names,
                                     std::string_view fallback) noexcept {
  const auto i = static_cast<std::size_t>(value);
  return i < N ? names[i] : fallback;
}

// The value named `name`, or nothing; callers throw their own error, which
// names the value and the accepted names.
template <typename E, std::size_t N>
constexpr std::optional<E> enum_from_name(std::string_view name,
                                          const std::array<std::string_view, N>& names) noexcept {
  for (std::size_t i = 0; i < N; ++i) {
    if (names[i] == name) return static_cast<E>(i);
  }
  return std::nullopt;
}

// "a, b or c": the accepted names, for an error message.
template <std::size_t N>
std::string enum_choices(const std::array<std::string_view, N>& names) {
  std::string out;
  for (std::size_t i = 0; i < N; ++i) {
    if (i > 0) out += i + 1 == N ? " or " : ", ";
    out += names[i];
  }
  return out;
}

}  // namespace mstar::kv
