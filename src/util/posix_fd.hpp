// Copyright mstar-kv authors.
//
// Small POSIX helpers the same-host engines share (internal): a closing fd,
// pidfds, which pin one process immune to pid reuse, and opening another
// process's file descriptor with every check a reader of its memory needs.
#pragma once

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace mstar::kv::posix {

// Closes on scope exit.
class Fd {
 public:
  explicit Fd(int fd) noexcept : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
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

// strerror(err).
std::string errno_text(int err);

// Another process's file, opened read-only: the fd and what fstat said.
struct PeerFile {
  Fd fd;
  struct stat st {};
};

// Opens `path` (/proc/PID/fd/N of another process) as a same-host reader of
// its memory must: looked at before opening, and opened non-blocking (a
// forged fd may name a FIFO, where open would block, or a device); then the
// file must belong to `uid`. Throws Error, each message starting "<who>: ":
// kStaleDescriptor `not_regular` for anything but a regular file;
// kPermissionDenied when open is refused (`denied_why` appended) or the
// `what` belongs to another uid; kNotFound when the fd is gone; kInternal.
PeerFile open_peer_file(const std::string& path, const std::string& who, std::uint32_t uid,
                        std::string_view not_regular, std::string_view denied_why,
                        std::string_view what);

}  // namespace mstar::kv::posix
