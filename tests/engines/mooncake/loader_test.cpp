// Copyright mstar-kv authors.
//
// The Mooncake loader against libraries that are absent, wrong or partial.
// Runs everywhere: none of these needs Mooncake.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "engines/mooncake/mooncake_api.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::mooncake {
namespace {

Status load_error(const std::string& path) {
  try {
    MooncakeLibrary lib(path);
  } catch (const Error& e) {
    return e.status();
  }
  return Status::ok();
}

bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

TEST(MooncakeLoader, AbsentLibraryIsUnavailableAndNamesThePathAndTheFix) {
  const std::string path = "/nonexistent/dir/libtransfer_engine.so";
  const Status s = load_error(path);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(s.message(), "cannot load Mooncake library '" + path + "'")) << s.message();
  EXPECT_TRUE(contains(s.message(), "--mooncake-lib")) << s.message();
  EXPECT_TRUE(contains(s.message(), "MSTAR_KV_MOONCAKE_LIB")) << s.message();
}

TEST(MooncakeLoader, LibraryWithoutTheCApiNamesTheFirstMissingSymbol) {
  // libm loads fine but has no transfer-engine symbol at all.
  const Status s = load_error("libm.so.6");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(s.message(), "'libm.so.6'")) << s.message();
  EXPECT_TRUE(contains(s.message(), "'createTransferEngine'")) << s.message();
}

TEST(MooncakeLoader, PartialLibraryNamesTheSymbolItLacks) {
  const Status s = load_error(MSTAR_KV_TEST_PARTIAL_LIB);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(s.message(), "lacks the C API symbol 'openSegment'")) << s.message();
  EXPECT_FALSE(contains(s.message(), "'createTransferEngine'")) << s.message();
}

TEST(MooncakeLoader, PathComesFromOptionThenEnvironmentThenDefault) {
  const char* saved = std::getenv(kLibEnv);
  const std::string saved_value = saved != nullptr ? saved : "";
  ::unsetenv(kLibEnv);
  EXPECT_EQ(resolve_library_path({}), "libtransfer_engine.so");
  ::setenv(kLibEnv, "/from/env.so", 1);
  EXPECT_EQ(resolve_library_path({}), "/from/env.so");
  EXPECT_EQ(resolve_library_path({{"mooncake_lib", "/from/option.so"}}), "/from/option.so");
  EXPECT_EQ(resolve_library_path({{"mooncake_lib", ""}}), "/from/env.so");
  if (saved != nullptr) {
    ::setenv(kLibEnv, saved_value.c_str(), 1);
  } else {
    ::unsetenv(kLibEnv);
  }
}

TEST(MooncakeLoader, RealLibraryResolvesEverySymbolWhenConfigured) {
  const char* lib = std::getenv(kLibEnv);
  if (lib == nullptr || *lib == '\0') {
    GTEST_SKIP() << kLibEnv << " is not set: no Mooncake library to load (the PyPI "
                 << "wheel has no C API; build Mooncake's libtransfer_engine.so)";
  }
  MooncakeLibrary loaded(lib);
  EXPECT_EQ(loaded.path(), lib);
  EXPECT_NE(loaded.api().createTransferEngine, nullptr);
  EXPECT_NE(loaded.api().freeBatchID, nullptr);
  MooncakeLibrary moved(std::move(loaded));
  EXPECT_NE(moved.api().getTransferStatus, nullptr);
}

TEST(MooncakeLoader, StatusNamesAreReadable) {
  EXPECT_EQ(status_code_name(3), "AddressNotRegistered (3)");
  EXPECT_EQ(status_code_name(12345), "code (12345)");
  EXPECT_STREQ(task_status_name(4), "COMPLETED");
  EXPECT_TRUE(is_final(6));
  EXPECT_FALSE(is_final(0));
  EXPECT_FALSE(is_final(1));
  EXPECT_FALSE(is_final(5));  // TIMEOUT: slices may still be in flight
}

}  // namespace
}  // namespace mstar::kv::mooncake
