// Copyright mstar-kv authors.
//
// Clang thread-safety annotations (MSTAR_KV_GUARDED_BY, MSTAR_KV_REQUIRES,
// ...), checked by the thread-safety build; nothing except under clang.
#pragma once

#include <mutex>

// Clang thread-safety analysis
// (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html), prefixed so that
// they never clash with an application's own macros. The thread-safety build
// (CMakePresets.json "thread-safety": clang, libc++ with its std::mutex
// annotated, -Wthread-safety -Werror, run by ./scripts/test) checks them.
//
//   std::mutex mu_;
//   int count_ MSTAR_KV_GUARDED_BY(mu_) = 0;
//   void bump_locked() MSTAR_KV_REQUIRES(mu_);
//
// std::lock_guard is understood; std::unique_lock is not: code that needs
// one (condition variables, unlocking to call out) takes an
// mstar::kv::internal::UniqueLock instead, which is one and is annotated. A
// condition variable's predicate (a lambda, analysed on its own) says that
// it runs under the lock with MSTAR_KV_ASSERT_HELD(mu_).
#if defined(__clang__)
#define MSTAR_KV_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define MSTAR_KV_THREAD_ANNOTATION(x)
#endif

#define MSTAR_KV_GUARDED_BY(x) MSTAR_KV_THREAD_ANNOTATION(guarded_by(x))
#define MSTAR_KV_PT_GUARDED_BY(x) MSTAR_KV_THREAD_ANNOTATION(pt_guarded_by(x))
#define MSTAR_KV_REQUIRES(...) MSTAR_KV_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define MSTAR_KV_EXCLUDES(...) MSTAR_KV_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define MSTAR_KV_NO_THREAD_SAFETY_ANALYSIS MSTAR_KV_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace mstar::kv::internal {

// A std::unique_lock<std::mutex> the analysis understands: it holds `mu`
// from construction to destruction, except between unlock() and lock().
class MSTAR_KV_THREAD_ANNOTATION(scoped_lockable) UniqueLock : public std::unique_lock<std::mutex> {
 public:
  explicit UniqueLock(std::mutex& mu) MSTAR_KV_THREAD_ANNOTATION(acquire_capability(mu))
      : std::unique_lock<std::mutex>(mu) {}
  ~UniqueLock() MSTAR_KV_THREAD_ANNOTATION(release_capability()) {}
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;
  void lock() MSTAR_KV_THREAD_ANNOTATION(acquire_capability()) {
    std::unique_lock<std::mutex>::lock();
  }
  void unlock() MSTAR_KV_THREAD_ANNOTATION(release_capability()) {
    std::unique_lock<std::mutex>::unlock();
  }
};

// Tells the analysis that `mu` is held (by a std::unique_lock the caller
// took): no code, no check at run time.
template <class Mutex>
inline void assert_held(const Mutex& mu) noexcept
    MSTAR_KV_THREAD_ANNOTATION(assert_capability(mu)) {
  (void)mu;
}

}  // namespace mstar::kv::internal

#define MSTAR_KV_ASSERT_HELD(mu) ::mstar::kv::internal::assert_held(mu)
