// Copyright mstar-kv authors.
//
// CmaPeer: reading an owner's private cache with process_vm_readv, with the
// checks that keep a stale or forged descriptor from being read.
#include "cma_reader.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <utility>

#include "cma_anchor.hpp"
#include "core/shared_word.hpp"
#include "mstar/kv/core/epochs.hpp"
#include "shm_memory.hpp"
#include "span_copy.hpp"
#include "util/posix_fd.hpp"

namespace mstar::kv::shm {

namespace {

#ifdef IOV_MAX
constexpr std::size_t kIovMax = IOV_MAX;
#else
constexpr std::size_t kIovMax = 1024;
#endif

// The iovecs of one side of a batch of runs, merging a run into the one
// before when it continues it.
class IovList {
 public:
  IovList() { v_.reserve(kIovMax); }
  bool full() const noexcept { return v_.size() == kIovMax; }
  // Room for one more run (merged or not)?
  bool fits(std::uint64_t addr) const noexcept { return !full() || continues(addr); }
  void add(std::uint64_t addr, std::uint64_t n) {
    if (continues(addr)) {
      v_.back().iov_len += n;
      return;
    }
    v_.push_back({reinterpret_cast<void*>(static_cast<std::uintptr_t>(addr)), n});
  }
  const iovec* data() const noexcept { return v_.data(); }
  std::size_t size() const noexcept { return v_.size(); }
  void clear() noexcept { v_.clear(); }

 private:
  bool continues(std::uint64_t addr) const noexcept {
    return !v_.empty() &&
           reinterpret_cast<std::uintptr_t>(v_.back().iov_base) + v_.back().iov_len == addr;
  }
  std::vector<iovec> v_;
};

// Runs for process_vm_readv, gathered on both sides (neighbours merged) and
// read with one call whenever either side is full, then at flush(). `read`
// is called as read(local, nlocal, remote, nremote, bytes).
template <typename Read>
class VmReadBatch {
 public:
  VmReadBatch(IovList& local, IovList& remote, Read read)
      : local_(local), remote_(remote), read_(read) {
    local_.clear();
    remote_.clear();
  }
  Status add(std::uint64_t local_addr, std::uint64_t remote_addr, std::uint64_t n) {
    if (!local_.fits(local_addr) || !remote_.fits(remote_addr)) {
      if (Status s = flush(); !s.is_ok()) return s;
    }
    local_.add(local_addr, n);
    remote_.add(remote_addr, n);
    bytes_ += n;
    return Status::ok();
  }
  Status flush() {
    if (remote_.size() == 0) return Status::ok();
    Status s = read_(local_.data(), local_.size(), remote_.data(), remote_.size(), bytes_);
    local_.clear();
    remote_.clear();
    bytes_ = 0;
    return s;
  }

 private:
  IovList& local_;
  IovList& remote_;
  Read read_;
  std::size_t bytes_ = 0;
};

std::string yama_scope() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  std::string v;
  if (!(f >> v)) return "";
  return v;
}

}  // namespace

std::string cma_permission_hint() {
  const std::string scope = yama_scope();
  std::string why;
  if (scope == "1") {
    why =
        "Yama's kernel.yama.ptrace_scope is 1 (/proc/sys/kernel/yama/ptrace_scope): only the "
        "owner's ancestors may read its memory; set it to 0 (sysctl -w "
        "kernel.yama.ptrace_scope=0), or have the owner allow its readers with "
        "prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)";
  } else if (scope == "2") {
    why =
        "Yama's kernel.yama.ptrace_scope is 2: only processes with CAP_SYS_PTRACE may read "
        "another's memory; set it to 0 or 1, or give the reader CAP_SYS_PTRACE";
  } else if (scope == "3") {
    why =
        "Yama's kernel.yama.ptrace_scope is 3: no process may read another's memory until "
        "reboot";
  } else {
    why = std::string(scope.empty() ? "no Yama on this kernel; "
                                    : "Yama's ptrace_scope is " + scope + "; ") +
          "the owner may be non-dumpable (prctl(PR_SET_DUMPABLE, 0), a setuid program), or a "
          "seccomp profile forbids process_vm_readv (containers: allow it, e.g. "
          "--cap-add SYS_PTRACE with Docker's default profile)";
  }
  return "reading another process's private memory (cross-memory attach) needs ptrace read "
         "access to it: " +
         why +
         "; or publish from shared memory (make_kv_cache(layout, kSharedHost), Python "
         "KVCache(layout, memory='shared')), which needs none of this";
}

std::string CmaPeer::who() const {
  return "shm cache of pid " + std::to_string(info_.pid) + " (private memory, cross-memory attach)";
}

Status CmaPeer::check_alive() const {
  if (pidfd_ >= 0 && posix::pidfd_exited(pidfd_)) {
    return {StatusCode::kNotFound,
            who() + ": owner process " + std::to_string(info_.pid) + " exited"};
  }
  return Status::ok();
}

Status CmaPeer::read(const iovec* local, std::size_t nlocal, const iovec* remote,
                     std::size_t nremote, std::size_t bytes, std::string_view what) const {
  const ssize_t n =
      ::process_vm_readv(static_cast<pid_t>(info_.pid), local, nlocal, remote, nremote, 0);
  if (n >= 0 && static_cast<std::size_t>(n) == bytes) return Status::ok();
  const int err = n < 0 ? errno : EFAULT;
  if (err == ESRCH || !check_alive().is_ok()) {
    return {StatusCode::kNotFound, who() + ": owner process " + std::to_string(info_.pid) +
                                       " exited (reading " + std::string(what) + ")"};
  }
  switch (err) {
    case EPERM:
    case EACCES:
      return {StatusCode::kPermissionDenied, who() + ": process_vm_readv refused reading " +
                                                 std::string(what) + " (" + errno_text(err) +
                                                 "): " + cma_permission_hint()};
    case EFAULT:
      return {
          StatusCode::kStaleDescriptor,
          who() + ": the owner no longer maps " + std::string(what) +
              (n >= 0 ? " (" + std::to_string(n) + " of " + std::to_string(bytes) + " bytes read)"
                      : std::string()) +
              ": the cache was freed or its engine shut down since the descriptor was made "
              "(or the descriptor is forged)"};
    case ENOMEM:
      return {StatusCode::kRetryLater,
              who() + ": process_vm_readv of " + std::string(what) + ": " + errno_text(err)};
    case ENOSYS:
      return {StatusCode::kUnavailable,
              who() +
                  ": this kernel has no process_vm_readv (CONFIG_CROSS_MEMORY_ATTACH): "
                  "publish from shared memory (kSharedHost) instead"};
    default:
      return {StatusCode::kInternal,
              who() + ": process_vm_readv of " + std::string(what) + ": " + errno_text(err)};
  }
}

std::shared_ptr<const CmaPeer> CmaPeer::open(const ShmKVTransferInfo& info) {
  std::shared_ptr<CmaPeer> p(new CmaPeer(info));
  const std::string who = p->who();
  const auto my_uid = static_cast<std::uint32_t>(::geteuid());
  if (info.uid != my_uid) {
    throw Error(StatusCode::kPermissionDenied,
                who + " belongs to uid " + std::to_string(info.uid) + ", this process is uid " +
                    std::to_string(my_uid) + ": KV caches are readable only by the same user");
  }
  // Pin the process, then check it is the one that published.
  p->pidfd_ = posix::open_pidfd(info.pid);
  if (p->pidfd_ < 0 && errno == ESRCH) {
    throw Error(StatusCode::kNotFound,
                who + ": owner process " + std::to_string(info.pid) + " no longer exists");
  }
  check_owner_identity(info.pid, info.start_time, who);
  // The anchor: the first read of the owner's memory, so the probe of
  // whether the kernel lets this process read it at all.
  const std::size_t count = info.regions.size();
  std::vector<std::uint64_t> words((sizeof(AnchorHeader) + 8 * count) / 8);
  const iovec local{words.data(), words.size() * 8};
  const iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(info.anchor)),
                     words.size() * 8};
  if (Status s = p->read(&local, 1, &remote, 1, local.iov_len,
                         "its anchor at " + hex_address(info.anchor));
      !s.is_ok()) {
    throw Error(std::move(s));
  }
  AnchorHeader h;
  std::memcpy(static_cast<void*>(&h), words.data(), sizeof h);
  const std::uint64_t* regions = words.data() + sizeof h / 8;
  if (h.magic != AnchorHeader::kMagic || h.nonce != info.nonce) {
    throw Error(p->nonce_status(h.magic == AnchorHeader::kMagic ? h.nonce : 0));
  }
  std::string differs;
  if (h.owner_pid != info.pid || h.owner_uid != info.uid)
    differs = "owner pid/uid";
  else if (h.layout_hash != layout_hash(info.layout))
    differs = "layout";
  else if (h.num_pages != info.layout.num_pages)
    differs = "page count";
  else if (h.epochs_addr != info.epochs_addr)
    differs = "page epoch table address";
  else if (h.ready_addr != info.ready_addr)
    differs = "readiness words address";
  else if (h.region_bytes != info.region_bytes)
    differs = "region bytes";
  else if (h.num_regions != count)
    differs = "region count";
  else if (!std::equal(regions, regions + count, info.regions.begin()))
    differs = "region addresses";
  if (!differs.empty()) {
    throw Error(StatusCode::kStaleDescriptor, who + ": the descriptor's " + differs +
                                                  " differ from what the owner serves "
                                                  "under the same nonce (a forged descriptor)");
  }
  p->regions_ = count == 1 ? RegionMap::contiguous(info.regions[0])
                           : RegionMap::per_layer(info.layout, info.regions);
  if (info.backed) p->map_backing();
  // The owner may have died between the checks above and the read.
  if (Status s = p->check_alive(); !s.is_ok()) throw Error(std::move(s));
  return p;
}

CmaPeer::~CmaPeer() {
  if (backing_ != nullptr) ::munmap(const_cast<std::byte*>(backing_), backing_bytes_);
  if (pidfd_ >= 0) ::close(pidfd_);
}

Status CmaPeer::nonce_status(std::uint64_t found) const {
  return {StatusCode::kStaleDescriptor,
          who() + ": the owner's anchor at " + hex_address(info_.anchor) + " holds nonce " +
              std::to_string(found) + ", the descriptor's is " + std::to_string(info_.nonce) +
              ": the cache was re-allocated or its engine shut down since the descriptor was "
              "made"};
}

Status CmaPeer::read_words(std::uint64_t table, std::size_t word,
                           std::span<const std::uint32_t> pages, void* out,
                           std::uint64_t* nonce) const {
  IovList local;
  IovList remote;
  const std::string_view what = word == 8 ? "its page epochs" : "its readiness words";
  VmReadBatch batch(local, remote,
                    [&](const iovec* l, std::size_t nl, const iovec* r, std::size_t nr,
                        std::size_t bytes) { return read(l, nl, r, nr, bytes, what); });
  auto add = [&](void* dst, std::uint64_t src, std::size_t n) {
    return batch.add(reinterpret_cast<std::uintptr_t>(dst), src, n);
  };
  if (nonce != nullptr) {
    if (Status s = add(nonce, info_.anchor + 8, 8); !s.is_ok()) return s;
  }
  auto* o = static_cast<std::byte*>(out);
  for (std::size_t i = 0; i < pages.size(); ++i) {
    if (Status s = add(o + i * word, table + std::uint64_t{pages[i]} * word, word); !s.is_ok()) {
      return s;
    }
  }
  return batch.flush();
}

Status CmaPeer::verify(std::span<const std::uint32_t> pages, std::uint64_t epoch,
                       std::string_view when, bool after_copy) const {
  if (mapped_epochs_ != nullptr) {
    if (after_copy) std::atomic_thread_fence(std::memory_order_acquire);
    const std::uint64_t nonce = internal::load_acquire(mapped_nonce_);
    if (nonce != info_.nonce) return nonce_status(nonce);
    if (epoch == 0) return Status::ok();
    return check_page_epochs(mapped_epochs_, info_.layout.num_pages, pages, epoch, when,
                             after_copy);
  }
  std::uint64_t nonce = 0;
  std::vector<std::uint64_t> found(epoch != 0 ? pages.size() : 0);
  Status s = read_words(info_.epochs_addr, 8, epoch != 0 ? pages : std::span<const std::uint32_t>(),
                        found.data(), &nonce);
  if (!s.is_ok()) return s;
  if (nonce != info_.nonce) return nonce_status(nonce);
  for (std::size_t i = 0; i < found.size(); ++i) {
    if (found[i] != epoch) return stale_page_status(pages[i], found[i], epoch, when);
  }
  return Status::ok();
}

Status CmaPeer::copy(const RegionMap& dst, const StridedSpan* b, const StridedSpan* e,
                     bool streaming) const {
  thread_local IovList local;
  thread_local IovList remote;
  VmReadBatch batch(
      local, remote,
      [&](const iovec* l, std::size_t nl, const iovec* r, std::size_t nr, std::size_t bytes) {
        return read(l, nl, r, nr, bytes, "the cache's pages");
      });
  // One run of `n` bytes from the owner's `r` to `d`: what lies in the
  // region's whole pages from the mapping, the rest by the kernel.
  auto run = [&](std::uint64_t d, std::uint64_t r, std::uint64_t n, const Interior* in) {
    if (in == nullptr || r + n <= in->lo || r >= in->hi) return batch.add(d, r, n);
    const std::uint64_t lo = std::max(r, in->lo);
    const std::uint64_t hi = std::min(r + n, in->hi);
    if (lo > r) {
      if (Status st = batch.add(d, r, lo - r); !st.is_ok()) return st;
    }
    std::memcpy(reinterpret_cast<void*>(static_cast<std::uintptr_t>(d + (lo - r))),
                backing_ + in->file_offset + (lo - in->lo), hi - lo);
    return hi < r + n ? batch.add(d + (hi - r), hi, r + n - hi) : Status::ok();
  };
  bool streamed = false;
  for (const StridedSpan* s = b; s != e; ++s) {
    const Interior* in = interior_of(*s);
    if (const std::byte* rows = mapped_rows(*s, in); rows != nullptr) {
      copy_span_at(dst.pointer(s->local_offset), rows, *s, streaming, nullptr, nullptr);
      streamed = streamed || streaming;
      continue;
    }
    const std::uint64_t d = dst.address(s->local_offset);
    const std::uint64_t r = regions_.address(s->remote_offset);
    if (s->rows == 1 || (s->local_stride == s->length && s->remote_stride == s->length)) {
      if (Status st = run(d, r, s->bytes(), in); !st.is_ok()) return st;
      continue;
    }
    for (std::uint64_t i = 0; i < s->rows; ++i) {
      if (Status st = run(d + i * s->local_stride, r + i * s->remote_stride, s->length, in);
          !st.is_ok()) {
        return st;
      }
    }
  }
  if (streamed) stream_fence();
  return batch.flush();
}

namespace {

// The owner's readiness of `pages` through three reads a poll.
class CmaLayerWatch final : public LayerWatch {
 public:
  CmaLayerWatch(std::shared_ptr<const CmaPeer> peer, std::vector<std::uint32_t> pages,
                std::uint64_t epoch)
      : peer_(std::move(peer)),
        pages_(std::move(pages)),
        epoch_(epoch),
        layers_(peer_->info().layout.num_layers),
        before_(pages_.size()),
        after_(pages_.size()),
        words_(pages_.size()) {}

  Status poll(std::uint32_t* layers_ready) override {
    const auto now = std::chrono::steady_clock::now();
    // Between reads the last answer stands (the stream driver polls every
    // few tens of microseconds; each read here is three system calls).
    if (now < next_read_) {
      *layers_ready = floor_;
      return Status::ok();
    }
    next_read_ = now + kMinInterval;
    const ShmKVTransferInfo& info = peer_->info();
    std::uint64_t nonce = 0;
    Status s = peer_->read_words(info.epochs_addr, 8, pages_, before_.data(), &nonce);
    if (s.is_ok() && nonce != info.nonce) s = peer_->verify({}, 0, "");
    if (s.is_ok()) s = peer_->read_words(info.ready_addr, 4, pages_, words_.data(), nullptr);
    if (s.is_ok()) s = peer_->read_words(info.epochs_addr, 8, pages_, after_.data(), nullptr);
    if (!s.is_ok()) return with_layers(s);
    std::uint32_t lowest = layers_;
    for (std::size_t i = 0; i < pages_.size(); ++i) {
      if (before_[i] != epoch_) {
        return stale_page_status(pages_[i], before_[i], epoch_, "before its readiness was read");
      }
      // The seqlock: a word read while the page changed owner (a reset
      // readiness under the old epoch) says nothing; judge it only once the
      // epoch after it is the expected one.
      if (after_[i] != epoch_) {
        return stale_page_status(pages_[i], after_[i], epoch_, "while its readiness was read");
      }
      const std::uint32_t r = words_[i];
      if (Status odd = check_readiness_word(pages_[i], r, layers_, floor_); !odd.is_ok()) {
        return odd;
      }
      lowest = std::min(lowest, r);
    }
    floor_ = lowest;
    // Layers still missing: an owner that died will never mark them.
    if (floor_ < layers_) {
      if (Status alive = peer_->check_alive(); !alive.is_ok()) return with_layers(alive);
    }
    *layers_ready = floor_;
    return Status::ok();
  }

 private:
  static constexpr std::chrono::microseconds kMinInterval{50};

  Status with_layers(const Status& s) const {
    return {s.code(), s.message() + " with " + std::to_string(floor_) + " of " +
                          std::to_string(layers_) + " layers marked ready"};
  }

  std::shared_ptr<const CmaPeer> peer_;
  std::vector<std::uint32_t> pages_;
  std::uint64_t epoch_;
  std::uint32_t layers_;
  std::vector<std::uint64_t> before_;
  std::vector<std::uint64_t> after_;
  std::vector<std::uint32_t> words_;
  std::uint32_t floor_ = 0;
  std::chrono::steady_clock::time_point next_read_{};
};

}  // namespace

std::unique_ptr<LayerWatch> CmaPeer::watch(std::shared_ptr<const CmaPeer> self,
                                           std::vector<std::uint32_t> pages, std::uint64_t epoch) {
  return std::make_unique<CmaLayerWatch>(std::move(self), std::move(pages), epoch);
}

}  // namespace mstar::kv::shm
