// Copyright mstar-kv authors.
//
// The cuda_ipc engine's host tables (host_tables.hpp): the owner's page
// epochs and layer readiness words in a sealed memfd, opened by readers
// through /proc. Plain POSIX: these run without a GPU, the owner in this
// process or in a forked child.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "common/expectations.hpp"
#include "core/mapped_watch.hpp"
#include "engines/cuda_ipc/host_tables.hpp"

namespace mstar::kv::cuda_ipc {
namespace {

// The engine's watch over a view (cuda_ipc_streaming.cpp).
std::unique_ptr<LayerWatch> watch_of(std::shared_ptr<const HostTablesView> view,
                                     std::uint32_t layers, std::vector<std::uint32_t> pages,
                                     std::uint64_t epoch) {
  const HostTablesView* t = view.get();
  return make_mapped_layer_watch(
      t->ready(), t->epochs(), t->num_pages(), layers, std::move(pages), epoch,
      [t] { return t->check_owner(); }, std::move(view));
}

using namespace std::chrono_literals;

const auto kPid = static_cast<std::uint32_t>(::getpid());
const auto kUid = static_cast<std::uint32_t>(::geteuid());

TEST(CudaHostTables, AReaderSeesTheOwnersWordsThroughProc) {
  HostTables owner(8, 42);
  owner.epochs()[3] = 7;
  owner.ready()[3] = 2;
  HostTablesView view(kPid, static_cast<std::uint32_t>(owner.fd()), owner.uid(), 42, 8);
  EXPECT_EQ(view.epochs()[3], 7u);
  EXPECT_EQ(view.ready()[3], 2u);
  EXPECT_EQ(view.epochs()[0], 0u);  // zero-filled
  owner.ready()[5] = 9;             // later writes show through the mapping
  EXPECT_EQ(view.ready()[5], 9u);
  EXPECT_TRUE(view.check_owner().is_ok());
}

TEST(CudaHostTables, ForgedOrStaleDescriptorsAreRefusedNamingWhy) {
  HostTables owner(8, 42);
  const auto fd = static_cast<std::uint32_t>(owner.fd());
  testing::expect_error([&] { HostTablesView(kPid, fd, kUid, 43, 8); },
                        StatusCode::kStaleDescriptor, {"another cache"});
  testing::expect_error([&] { HostTablesView(kPid, fd, kUid, 42, 9); },
                        StatusCode::kStaleDescriptor, {"bytes"});
  testing::expect_error([&] { HostTablesView(kPid, fd, kUid + 1, 42, 8); },
                        StatusCode::kPermissionDenied, {"uid"});
  // An fd that names a pipe, an unsealed memfd of the right size, nothing.
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  testing::expect_error(
      [&] { HostTablesView(kPid, static_cast<std::uint32_t>(p[0]), kUid, 42, 8); },
      StatusCode::kStaleDescriptor, {"not a regular file"});
  ::close(p[0]);
  ::close(p[1]);
  const int m = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(m, 0);
  ASSERT_EQ(::ftruncate(m, static_cast<off_t>(host_tables_bytes(8))), 0);
  testing::expect_error([&] { HostTablesView(kPid, static_cast<std::uint32_t>(m), kUid, 42, 8); },
                        StatusCode::kStaleDescriptor, {"sealed"});
  ::close(m);
  testing::expect_error([&] { HostTablesView(kPid, 1u << 30, kUid, 42, 8); }, StatusCode::kNotFound,
                        {"does not exist"});
}

TEST(CudaHostTables, TheWatchFollowsReadinessAndRefusesWhatAnOwnerCannotSay) {
  HostTables owner(8, 42);
  const std::vector<std::uint32_t> pages{1, 4};
  for (std::uint32_t p : pages) owner.epochs()[p] = 5;
  auto view = std::make_shared<const HostTablesView>(kPid, static_cast<std::uint32_t>(owner.fd()),
                                                     owner.uid(), 42, 8);
  PageReadiness ready(owner.ready(), 8);
  auto watch = watch_of(view, 4, pages, 5);
  std::uint32_t r = 99;
  ASSERT_TRUE(watch->poll(&r).is_ok());
  EXPECT_EQ(r, 0u);
  ready.stamp(std::vector<std::uint32_t>{1}, 2);
  ASSERT_TRUE(watch->poll(&r).is_ok());
  EXPECT_EQ(r, 0u);  // the minimum over the pages
  ready.stamp(pages, 2);
  ASSERT_TRUE(watch->poll(&r).is_ok());
  EXPECT_EQ(r, 2u);
  ready.stamp(pages, 1);  // backwards
  EXPECT_EQ(watch->poll(&r).code(), StatusCode::kCorruptDescriptor);

  auto beyond = watch_of(view, 4, pages, 5);
  ready.stamp(pages, 5);  // beyond 4 layers
  EXPECT_EQ(beyond->poll(&r).code(), StatusCode::kCorruptDescriptor);

  auto stale = watch_of(view, 4, pages, 5);
  ready.stamp(pages, 3);
  ASSERT_TRUE(stale->poll(&r).is_ok());
  EXPECT_EQ(r, 3u);
  owner.epochs()[4] = 6;  // the page changed owner
  EXPECT_EQ(stale->poll(&r).code(), StatusCode::kStaleDescriptor);
}

// An owner killed mid-stream: its tables stay mapped, but the watch sees the
// process gone (a zombie too: nobody reaps it before the check).
TEST(CudaHostTables, AnOwnerKilledMidStreamIsSeenGone) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(p[0]);
    try {
      HostTables t(4, 9);
      t.epochs()[0] = 3;
      t.ready()[0] = 1;
      const int fd = t.fd();
      if (::write(p[1], &fd, sizeof fd) != sizeof fd) ::_exit(2);
      for (;;) ::pause();
    } catch (...) {
      ::_exit(3);
    }
  }
  ::close(p[1]);
  int fd = -1;
  ASSERT_EQ(::read(p[0], &fd, sizeof fd), static_cast<ssize_t>(sizeof fd));
  ::close(p[0]);
  auto view = std::make_shared<const HostTablesView>(static_cast<std::uint32_t>(child),
                                                     static_cast<std::uint32_t>(fd), kUid, 9, 4);
  auto watch = watch_of(view, 2, std::vector<std::uint32_t>{0}, 3);
  std::uint32_t r = 0;
  ASSERT_TRUE(watch->poll(&r).is_ok());
  EXPECT_EQ(r, 1u);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  Status st;
  const auto until = std::chrono::steady_clock::now() + 5s;
  while ((st = watch->poll(&r)).is_ok() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
  EXPECT_NE(st.message().find("1 of 2 layers"), std::string::npos) << st.to_string();
  int status = 0;
  ::waitpid(child, &status, 0);
}

}  // namespace
}  // namespace mstar::kv::cuda_ipc
