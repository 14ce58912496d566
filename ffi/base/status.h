// Errors inside the core are values: the XLA boundary turns them into
// ffi::Error, nanobind into Python exceptions. Library code never ends the
// process on its own (the one exception is JAX_ARX_ON_FAILURE=abort).
#pragma once

#include <cstdarg>
#include <cstdio>
#include <string>
#include <utility>

namespace arx {

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string message) {
    Status s;
    s.message_ = message.empty() ? std::string("jax_arx: unknown error") : std::move(message);
    return s;
  }
  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// printf-style formatting into a std::string, for error messages.
inline std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string strf(const char* fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
  va_copy(ap2, ap);
  const int n = vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string s(n > 0 ? (size_t)n : 0, '\0');
  if (n > 0) vsnprintf(s.data(), (size_t)n + 1, fmt, ap2);
  va_end(ap2);
  return s;
}

#define ARX_RETURN_IF_ERROR(expr)    \
  do {                               \
    ::arx::Status arx_s_ = (expr);   \
    if (!arx_s_.ok()) return arx_s_; \
  } while (0)

}  // namespace arx
