// Copyright mstar-kv authors.
#include "shm_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::shm {

void check_owner_identity(std::uint32_t pid, std::uint64_t start_time, const std::string& who) {
  if (const std::uint32_t tgid = thread_group_of(pid); tgid != 0 && tgid != pid) {
    throw Error(StatusCode::kStaleDescriptor,
                who + ": pid " + std::to_string(pid) + " names a thread of process " +
                    std::to_string(tgid) + ", not the descriptor's owner process");
  }
  const std::uint64_t start = process_start_time(static_cast<int>(pid));
  if (start == 0) {
    throw Error(StatusCode::kNotFound, who + ": owner process " + std::to_string(pid) +
                                           " no longer exists (" + errno_text(errno) + ")");
  }
  if (start != start_time) {
    throw Error(StatusCode::kStaleDescriptor,
                who + ": pid " + std::to_string(pid) + " now belongs to a process started at " +
                    std::to_string(start) + ", the descriptor's owner started at " +
                    std::to_string(start_time) + " (owner restarted)");
  }
}

namespace {

// /proc/<pid>/<file> into buf, NUL-terminated: its length, or -1 with errno
// set (EIO for an empty file).
ssize_t read_proc_file(int pid, const char* file, char* buf, std::size_t size) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/%s", pid, file);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  const ssize_t n = ::read(fd, buf, size - 1);
  const int err = errno;
  ::close(fd);
  if (n <= 0) {
    errno = n == 0 ? EIO : err;
    return -1;
  }
  buf[n] = '\0';
  return n;
}

}  // namespace

std::uint32_t thread_group_of(std::uint32_t pid) noexcept {
  char buf[2048];
  if (read_proc_file(static_cast<int>(pid), "status", buf, sizeof buf) < 0) return 0;
  const char* p = std::strstr(buf, "\nTgid:");
  if (p == nullptr) return 0;
  return static_cast<std::uint32_t>(std::strtoul(p + 6, nullptr, 10));
}

std::uint64_t process_start_time(int pid) noexcept {
  char buf[1024];
  if (read_proc_file(pid, "stat", buf, sizeof buf) < 0) return 0;
  // The command name (field 2) may hold spaces and parentheses: fields 3..
  // start after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) {
    errno = EIO;
    return 0;
  }
  ++p;
  // Field 22 is the 20th field after the ')'.
  for (int field = 3; field < 22; ++field) {
    while (*p == ' ') ++p;
    while (*p != ' ' && *p != '\0') ++p;
  }
  while (*p == ' ') ++p;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(p, &end, 10);
  if (end == p || errno != 0) {
    errno = EIO;
    return 0;
  }
  return v;
}

std::uint64_t random_nonce() {
  std::random_device rd;  // getrandom(2) on Linux
  std::uint64_t v = 0;
  while (v == 0) v = (std::uint64_t{rd()} << 32) ^ rd();
  return v;
}

namespace {

[[noreturn]] void fail_syscall(const char* call, std::size_t size, int err) {
  const StatusCode code = (err == ENOMEM || err == ENOSPC || err == EMFILE || err == ENFILE)
                              ? StatusCode::kRetryLater
                              : StatusCode::kInternal;
  throw Error(code, std::string("cannot allocate ") + std::to_string(size) +
                        " bytes of shared memory: " + call + ": " + errno_text(err));
}

}  // namespace

std::unique_ptr<SharedMemory> SharedMemory::create(std::size_t size, std::uint32_t num_pages) {
  std::unique_ptr<SharedMemory> m(new SharedMemory());
  m->size_ = size;
  m->epoch_pages_ = num_pages;
  m->fd_ = ::memfd_create("mstar-kv-cache", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (m->fd_ < 0) fail_syscall("memfd_create", size, errno);
  const std::size_t total = shm_file_bytes(size, num_pages);
  if (::ftruncate(m->fd_, static_cast<off_t>(total)) != 0) {
    fail_syscall("ftruncate", size, errno);
  }
  // Sealing the size is what makes readers SIGBUS-proof: the file can never
  // shrink under their mapping, whatever the owner does.
  if (::fcntl(m->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    fail_syscall("fcntl(F_ADD_SEALS)", size, errno);
  }
  // MAP_POPULATE allocates every page now: no first-touch fault later, when
  // a transfer writes into this cache.
  void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, m->fd_, 0);
  if (p == MAP_FAILED) fail_syscall("mmap", size, errno);
  m->base_ = static_cast<std::byte*>(p);
  m->nonce_ = random_nonce();
  m->owner_pid_ = static_cast<std::uint32_t>(::getpid());
  m->owner_uid_ = static_cast<std::uint32_t>(::geteuid());
  m->owner_start_time_ = process_start_time(::getpid());
  if (m->owner_start_time_ == 0) fail_syscall("read /proc/self/stat", size, errno);
  Header h;
  h.magic = Header::kMagic;
  h.nonce = m->nonce_;
  h.size = size;
  h.owner_pid = m->owner_pid_;
  h.owner_uid = m->owner_uid_;
  h.epoch_offset = epoch_table_offset(size);
  h.epoch_pages = num_pages;
  h.ready_offset = ready_table_offset(size, num_pages);
  std::memcpy(m->base_, &h, sizeof h);
  return m;
}

SharedMemory::~SharedMemory() {
  if (base_ != nullptr) ::munmap(base_, shm_file_bytes(size_, epoch_pages_));
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace mstar::kv::shm
