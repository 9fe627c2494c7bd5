// Copyright mstar-kv authors.
#include "host_tables.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "mstar/kv/util/status.hpp"
#include "util/posix_fd.hpp"

namespace mstar::kv::cuda_ipc {

namespace {

struct Header {
  static constexpr std::uint64_t kMagic = 0x3173656c62'61546b;  // "kTables1"
  std::uint64_t magic = 0;
  std::uint64_t generation = 0;
  std::uint32_t num_pages = 0;
  std::uint8_t pad[44] = {};
};
static_assert(sizeof(Header) == 64);

using posix::errno_text;
using posix::Fd;

[[noreturn]] void fail_syscall(const char* call, int err) {
  const StatusCode code = (err == ENOMEM || err == ENOSPC || err == EMFILE || err == ENFILE)
                              ? StatusCode::kRetryLater
                              : StatusCode::kInternal;
  throw Error(code, std::string("cuda_ipc host tables: ") + call + ": " + errno_text(err));
}

}  // namespace

std::uint64_t host_tables_bytes(std::uint32_t num_pages) noexcept {
  return sizeof(Header) + std::uint64_t{num_pages} * 12;
}

HostTables::HostTables(std::uint32_t num_pages, std::uint64_t generation)
    : num_pages_(num_pages), uid_(static_cast<std::uint32_t>(::geteuid())) {
  Fd fd(::memfd_create("mstar-kv-cuda-tables", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd.get() < 0) fail_syscall("memfd_create", errno);
  const std::uint64_t bytes = host_tables_bytes(num_pages);
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) fail_syscall("ftruncate", errno);
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    fail_syscall("fcntl(F_ADD_SEALS)", errno);
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
  if (p == MAP_FAILED) fail_syscall("mmap", errno);
  base_ = static_cast<std::byte*>(p);
  Header h;
  h.magic = Header::kMagic;
  h.generation = generation;
  h.num_pages = num_pages;
  std::memcpy(base_, &h, sizeof h);
  fd_ = fd.release();
}

HostTables::~HostTables() {
  if (base_ != nullptr) ::munmap(base_, host_tables_bytes(num_pages_));
  if (fd_ >= 0) ::close(fd_);
}

std::uint64_t* HostTables::epochs() const noexcept {
  return reinterpret_cast<std::uint64_t*>(base_ + sizeof(Header));
}

std::uint32_t* HostTables::ready() const noexcept {
  return reinterpret_cast<std::uint32_t*>(base_ + sizeof(Header) + std::size_t{num_pages_} * 8);
}

HostTablesView::HostTablesView(std::uint32_t owner_pid, std::uint32_t fd, std::uint32_t uid,
                               std::uint64_t generation, std::uint32_t num_pages)
    : num_pages_(num_pages) {
  const std::string path = "/proc/" + std::to_string(owner_pid) + "/fd/" + std::to_string(fd);
  const std::string who = "cuda_ipc readiness tables of pid " + std::to_string(owner_pid) +
                          " (fd " + std::to_string(fd) + ")";
  // Pin the owner first: its exit is then seen whatever reuses its pid.
  Fd pidfd(posix::open_pidfd(owner_pid));
  if (pidfd.get() < 0 && errno == ESRCH) {
    throw Error(StatusCode::kNotFound,
                who + ": owner process " + std::to_string(owner_pid) + " no longer exists");
  }
  const posix::PeerFile file = posix::open_peer_file(
      path, who, uid, "not a regular file: the owner closed its tables and reused the fd",
      "(only the owner's user may watch its readiness)", "file");
  const Fd& f = file.fd;
  const struct stat& st = file.st;
  const int seals = ::fcntl(f.get(), F_GET_SEALS);
  const std::uint64_t want = host_tables_bytes(num_pages);
  if (!S_ISREG(st.st_mode) || seals < 0 || (seals & F_SEAL_SHRINK) == 0 ||
      static_cast<std::uint64_t>(st.st_size) != want) {
    throw Error(StatusCode::kStaleDescriptor, who + ": not sealed mstar-kv tables of " +
                                                  std::to_string(want) +
                                                  " bytes (the fd names something else now)");
  }
  void* p = ::mmap(nullptr, want, PROT_READ, MAP_SHARED, f.get(), 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw Error(err == ENOMEM ? StatusCode::kRetryLater : StatusCode::kInternal,
                who + ": mmap of " + std::to_string(want) + " bytes: " + errno_text(err));
  }
  base_ = static_cast<const std::byte*>(p);
  path_ = path;
  who_ = who;
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  pidfd_ = pidfd.release();
  Header h;
  std::memcpy(&h, base_, sizeof h);
  if (h.magic != Header::kMagic || h.generation != generation || h.num_pages != num_pages) {
    ::munmap(const_cast<std::byte*>(base_), want);
    base_ = nullptr;
    ::close(std::exchange(pidfd_, -1));
    throw Error(StatusCode::kStaleDescriptor,
                who + ": the tables belong to another cache (generation or page count differs)");
  }
}

HostTablesView::~HostTablesView() {
  if (base_ != nullptr) {
    ::munmap(const_cast<std::byte*>(base_), host_tables_bytes(num_pages_));
  }
  if (pidfd_ >= 0) ::close(pidfd_);
}

Status HostTablesView::check_owner() const {
  if (pidfd_ >= 0 && posix::pidfd_exited(pidfd_)) {
    return {StatusCode::kNotFound, who_ + ": the owner process exited"};
  }
  // The fd entry must still name these very tables (the inode cannot be
  // recycled while this mapping holds it).
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    return {StatusCode::kNotFound, who_ + ": " + path_ + " is gone (" + errno_text(errno) +
                                       "): the cache was freed or its owner exited"};
  }
  if (st.st_dev != dev_ || st.st_ino != ino_) {
    return {StatusCode::kStaleDescriptor,
            who_ + ": the fd now names other memory: the cache was re-allocated"};
  }
  return Status::ok();
}

const std::uint64_t* HostTablesView::epochs() const noexcept {
  return reinterpret_cast<const std::uint64_t*>(base_ + sizeof(Header));
}

const std::uint32_t* HostTablesView::ready() const noexcept {
  return reinterpret_cast<const std::uint32_t*>(base_ + sizeof(Header) +
                                                std::size_t{num_pages_} * 8);
}

}  // namespace mstar::kv::cuda_ipc
