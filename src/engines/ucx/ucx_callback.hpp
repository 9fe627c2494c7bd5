// Copyright mstar-kv authors.
//
// How UCX calls back into the ucx engine (internal to the engine):
//   - trampoline<Body, Guard>: the one entry point of every C callback the
//     engine hands to UCX. No exception may cross into UCX (a C library),
//     so the trampoline is noexcept; an exception out of Body (an
//     allocation failing on the progress thread, in practice) goes to the
//     Guard, which fails the read the callback served.
//   - InFlight<T>: the owner of the objects a UCX request points at (its
//     user_data) from posting until the request completes; what UCX never
//     completes is destroyed with the owner.
#pragma once

#include <exception>
#include <memory>
#include <type_traits>
#include <unordered_map>

namespace mstar::kv::ucx {

// Guard is constructed from the callback's arguments before Body runs (so
// it reads what failing needs before Body may free it); it must be
// noexcept to construct, and its failed(std::exception_ptr) noexcept.
// On failure the callback returns R{} (UCS_OK for handlers returning a
// status: the message is dropped).
template <auto Body, class Guard>
struct Trampoline;

template <class R, class... A, R (*Body)(A...), class Guard>
struct Trampoline<Body, Guard> {
  static_assert(std::is_nothrow_constructible_v<Guard, A...>);
  static R call(A... a) noexcept {
    Guard guard(a...);
    try {
      return Body(a...);
    } catch (...) {
      guard.failed(std::current_exception());
    }
    if constexpr (!std::is_void_v<R>) return R{};
  }
};

template <auto Body, class Guard>
inline constexpr auto trampoline = &Trampoline<Body, Guard>::call;

template <class T>
class InFlight {
 public:
  InFlight() = default;
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

  // Keeps `p` and returns the pointer to give UCX as user_data.
  T* add(std::unique_ptr<T> p) {
    T* raw = p.get();
    live_.emplace(raw, std::move(p));
    return raw;
  }
  // Gives `p` back (when its request completed, or was never started);
  // null when it is not held (any more).
  std::unique_ptr<T> take(T* p) noexcept {
    auto it = live_.find(p);
    if (it == live_.end()) return nullptr;
    std::unique_ptr<T> out = std::move(it->second);
    live_.erase(it);
    return out;
  }
  bool empty() const noexcept { return live_.empty(); }
  // Destroys what UCX did not complete: only once the worker is gone (or
  // the requests were written off), as UCX could still write through them.
  void clear() noexcept { live_.clear(); }

 private:
  std::unordered_map<T*, std::unique_ptr<T>> live_;
};

}  // namespace mstar::kv::ucx
