// flashkv::Error and the argument checks every public entry point uses.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace flashkv {

// The one exception type flashkv throws. Its message names the argument (or operation) at fault
// and, where there is one, the expected and the actual value.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
inline void stream_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void stream_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  stream_all(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<< into one string.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::stream_all(os, args...);
  return os.str();
}

[[noreturn]] inline void throw_error(const std::string& what) { throw Error(what); }

}  // namespace flashkv

// FLASHKV_CHECK(cond, "arg", ": expected ", x, ", got ", y): throws flashkv::Error with the
// concatenated message when cond is false.
#define FLASHKV_CHECK(cond, ...)                                          \
  do {                                                                    \
    if (!(cond)) ::flashkv::throw_error(::flashkv::str_cat(__VA_ARGS__)); \
  } while (0)

// Checks that `actual == expected` for the argument `name` and says both when not.
#define FLASHKV_CHECK_EQ(name, actual, expected)                                                 \
  do {                                                                                           \
    const auto& fkv_a_ = (actual);                                                               \
    const auto& fkv_e_ = (expected);                                                             \
    if (!(fkv_a_ == fkv_e_))                                                                     \
      ::flashkv::throw_error(::flashkv::str_cat(name, ": expected ", fkv_e_, ", got ", fkv_a_)); \
  } while (0)
