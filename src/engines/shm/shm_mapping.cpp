// Copyright mstar-kv authors.
//
// ShmMapping: opening another process's shared cache read-only, with every
// check that keeps a stale or forged descriptor from being read.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "mstar/kv/engines/shm.hpp"
#include "shm_mapping.hpp"
#include "shm_memory.hpp"
#include "util/posix_fd.hpp"

namespace mstar::kv {

namespace {

using shm::errno_text;

constexpr std::uint64_t kPopulateLimit = 8ull << 30;

std::string fd_path(const ShmKVTransferInfo& info) {
  return "/proc/" + std::to_string(info.pid) + "/fd/" + std::to_string(info.fd);
}

std::string owner_name(const ShmKVTransferInfo& info) {
  return "shm cache of pid " + std::to_string(info.pid) + " (fd " + std::to_string(info.fd) + ")";
}

using posix::Fd;
using posix::open_pidfd;
using posix::pidfd_exited;

}  // namespace

ShmMapping ShmMapping::open(const ShmKVTransferInfo& info) {
  const std::string who = owner_name(info);
  const auto my_uid = static_cast<std::uint32_t>(::geteuid());
  if (info.uid != my_uid) {
    throw Error(StatusCode::kPermissionDenied,
                who + " belongs to uid " + std::to_string(info.uid) + ", this process is uid " +
                    std::to_string(my_uid) +
                    ": shared KV caches are readable only by the same user");
  }
  // Pin the process first, then check it is the one that published: a pid
  // reused after the owner died has another start time.
  Fd pidfd(open_pidfd(info.pid));
  if (pidfd.get() < 0 && errno == ESRCH) {
    throw Error(StatusCode::kNotFound,
                who + ": owner process " + std::to_string(info.pid) + " no longer exists");
  }
  shm::check_owner_identity(info.pid, info.start_time, who);
  const std::string path = fd_path(info);
  const posix::PeerFile file = posix::open_peer_file(
      path, who, info.uid,
      "fd " + std::to_string(info.fd) +
          " is not a shared cache (not a regular file): the cache was freed and the fd reused",
      "(only the owner's user may map its cache)", "memory");
  const Fd& fd = file.fd;
  const struct stat& st = file.st;
  // Only a size-sealed memfd is ours: the seal is what keeps SIGBUS away.
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  const std::uint64_t want = shm::shm_file_bytes(info.size, info.layout.num_pages);
  if (!S_ISREG(st.st_mode) || seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    throw Error(StatusCode::kStaleDescriptor,
                who + ": fd " + std::to_string(info.fd) +
                    " is not a sealed mstar-kv shared cache (the cache was freed and the fd "
                    "reused)");
  }
  if (static_cast<std::uint64_t>(st.st_size) != want) {
    throw Error(StatusCode::kStaleDescriptor,
                who + ": the memory holds " + std::to_string(st.st_size) +
                    " bytes, the descriptor needs " + std::to_string(want) +
                    " (header + size + page epochs + readiness): another cache now has this fd");
  }
  // MAP_POPULATE maps every page now, once per peer, instead of one fault
  // per 4 KiB page inside the copies; above kPopulateLimit the first reads
  // fault pages in instead, so that opening a huge cache stays quick.
  const int populate = want <= kPopulateLimit ? MAP_POPULATE : 0;
  void* p = ::mmap(nullptr, want, PROT_READ, MAP_SHARED | populate, fd.get(), 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw Error(err == ENOMEM ? StatusCode::kRetryLater : StatusCode::kInternal,
                who + ": mmap of " + std::to_string(want) + " bytes: " + errno_text(err));
  }
  ShmMapping m;
  m.info_ = info;
  m.base_ = static_cast<std::byte*>(p);
  m.mapped_bytes_ = want;
  m.dev_ = st.st_dev;
  m.ino_ = st.st_ino;
  shm::Header h;
  std::memcpy(&h, m.base_, sizeof h);
  // /proc/<tid>/fd of one of the owner's threads names the same memory: a
  // descriptor naming a thread (or any other pid) is not the owner's.
  if (h.magic == shm::Header::kMagic && (h.owner_pid != info.pid || h.owner_uid != info.uid)) {
    throw Error(StatusCode::kStaleDescriptor,
                who + ": the memory belongs to pid " + std::to_string(h.owner_pid) +
                    ", not the descriptor's pid " + std::to_string(info.pid) +
                    " (a thread of the owner, or a forged pid)");
  }
  if (h.magic != shm::Header::kMagic || h.nonce != info.nonce || h.size != info.size ||
      h.epoch_offset != shm::epoch_table_offset(info.size) ||
      h.epoch_pages != info.layout.num_pages ||
      h.ready_offset != shm::ready_table_offset(info.size, info.layout.num_pages)) {
    throw Error(StatusCode::kStaleDescriptor,
                who + ": generation mismatch (the cache's nonce is " + std::to_string(h.nonce) +
                    ", the descriptor's " + std::to_string(info.nonce) +
                    "): the cache was re-allocated since the descriptor was made");
  }
  m.pidfd_ = pidfd.release();
  // The owner may have died between the checks above and the open.
  if (Status s = m.check_owner(); !s.is_ok()) throw Error(s);
  return m;
}

Status ShmMapping::check_owner() const {
  const std::string who = owner_name(info_);
  if (pidfd_ >= 0 && pidfd_exited(pidfd_)) {
    return {StatusCode::kNotFound,
            who + ": owner process " + std::to_string(info_.pid) + " exited"};
  }
  // The fd entry must still name this very memory: same device and inode
  // (the inode cannot be recycled while this mapping holds it).
  struct stat st {};
  const std::string path = fd_path(info_);
  if (::stat(path.c_str(), &st) != 0) {
    return {StatusCode::kNotFound, who + ": " + path + " is gone (" + errno_text(errno) +
                                       "): the cache was freed or its owner exited"};
  }
  if (st.st_dev != dev_ || st.st_ino != ino_) {
    return {StatusCode::kStaleDescriptor,
            who + ": fd " + std::to_string(info_.fd) +
                " now names other memory: the cache was re-allocated"};
  }
  return Status::ok();
}

void ShmMapping::reset() noexcept {
  if (base_ != nullptr) ::munmap(base_, mapped_bytes_);
  if (pidfd_ >= 0) ::close(pidfd_);
  base_ = nullptr;
  mapped_bytes_ = 0;
  pidfd_ = -1;
}

ShmMapping::ShmMapping(ShmMapping&& other) noexcept
    : info_(other.info_),
      base_(std::exchange(other.base_, nullptr)),
      mapped_bytes_(std::exchange(other.mapped_bytes_, 0)),
      pidfd_(std::exchange(other.pidfd_, -1)),
      dev_(other.dev_),
      ino_(other.ino_) {}

ShmMapping& ShmMapping::operator=(ShmMapping&& other) noexcept {
  if (this != &other) {
    reset();
    info_ = other.info_;
    base_ = std::exchange(other.base_, nullptr);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
    pidfd_ = std::exchange(other.pidfd_, -1);
    dev_ = other.dev_;
    ino_ = other.ino_;
  }
  return *this;
}

ShmMapping::~ShmMapping() { reset(); }

ShmCacheView map_shm_cache(const KVTransferInfo& info) {
  const ShmKVTransferInfo si = ShmKVTransferInfo::decode(info);
  if (si.access != ShmKVTransferInfo::Access::kMemfd) {
    throw Error(StatusCode::kInvalidArgument,
                "shm cache of pid " + std::to_string(si.pid) +
                    " is private memory (read by cross-memory attach), not a shared memfd: it "
                    "cannot be mapped");
  }
  auto mapping = std::make_shared<const ShmMapping>(ShmMapping::open(si));
  const std::byte* data = mapping->data();
  // Aliasing: the view's pointer owns the mapping.
  return ShmCacheView{std::shared_ptr<const std::byte>(mapping, data), si.layout};
}

}  // namespace mstar::kv
