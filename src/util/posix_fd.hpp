// Copyright mstar-kv authors.
//
// Small POSIX helpers the same-host engines share (internal): a closing fd
// and pidfds, which pin one process immune to pid reuse.
#pragma once

#include <poll.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <utility>

namespace mstar::kv::posix {

// Closes on scope exit.
class Fd {
 public:
  explicit Fd(int fd) noexcept : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const noexcept { return fd_; }
  int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// pidfd_open(2): -1 with errno when unavailable (ESRCH: no such process).
inline int open_pidfd(std::uint32_t pid) noexcept {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0u));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

// A pidfd becomes readable when its process exits (a zombie too).
inline bool pidfd_exited(int pidfd) noexcept {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

}  // namespace mstar::kv::posix
