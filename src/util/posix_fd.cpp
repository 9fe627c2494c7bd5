// Copyright mstar-kv authors.
#include "util/posix_fd.hpp"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::posix {

std::string errno_text(int err) { return std::strerror(err); }

PeerFile open_peer_file(const std::string& path, const std::string& who, std::uint32_t uid,
                        std::string_view not_regular, std::string_view denied_why,
                        std::string_view what) {
  struct stat pre {};
  if (::stat(path.c_str(), &pre) == 0 && !S_ISREG(pre.st_mode)) {
    throw Error(StatusCode::kStaleDescriptor, who + ": " + std::string(not_regular));
  }
  PeerFile f{Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY))};
  if (f.fd.get() < 0) {
    const int err = errno;
    if (err == EACCES || err == EPERM) {
      throw Error(
          StatusCode::kPermissionDenied,
          who + ": cannot open " + path + ": " + errno_text(err) + " " + std::string(denied_why));
    }
    if (err == ENOENT || err == ESRCH) {
      throw Error(StatusCode::kNotFound,
                  who + ": " + path + " does not exist: the cache was freed or its owner exited");
    }
    throw Error(StatusCode::kInternal, who + ": open " + path + ": " + errno_text(err));
  }
  if (::fstat(f.fd.get(), &f.st) != 0) {
    throw Error(StatusCode::kInternal, who + ": fstat: " + errno_text(errno));
  }
  if (f.st.st_uid != uid) {
    throw Error(StatusCode::kPermissionDenied,
                who + ": the " + std::string(what) + " belongs to uid " +
                    std::to_string(f.st.st_uid) + ", the descriptor says uid " +
                    std::to_string(uid));
  }
  return f;
}

}  // namespace mstar::kv::posix
