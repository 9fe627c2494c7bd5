// Copyright mstar-kv authors.
//
// Atomic loads and stores of words shared with other processes (the page
// epoch and readiness tables, which readers may map PROT_READ): the
// compiler's __atomic builtins, which are what std::atomic_ref compiles to,
// usable on a const word (a load never writes) and with every standard
// library we build against (libc++ 14, used by the thread-safety build, has
// no std::atomic_ref). Aligned 4- and 8-byte words only.
#pragma once

#include <type_traits>

namespace mstar::kv::internal {

template <class T>
T load_acquire(const T* w) noexcept {
  static_assert(std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8));
  return __atomic_load_n(w, __ATOMIC_ACQUIRE);
}
template <class T>
void store_release(T* w, T v) noexcept {
  static_assert(std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8));
  __atomic_store_n(w, v, __ATOMIC_RELEASE);
}
template <class T>
void store_relaxed(T* w, T v) noexcept {
  static_assert(std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8));
  __atomic_store_n(w, v, __ATOMIC_RELAXED);
}

template <class T>
void store_seq_cst(T* w, T v) noexcept {
  static_assert(std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8));
  __atomic_store_n(w, v, __ATOMIC_SEQ_CST);
}

}  // namespace mstar::kv::internal
