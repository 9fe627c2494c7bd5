// Copyright mstar-kv authors.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "commands.hpp"
#include "mstar/kv/util/status.hpp"

namespace {

using Command = int (*)(int, char**);
struct Entry {
  const char* name;
  Command run;
  const char* help;
};

constexpr Entry kCommands[] = {
    {"info", &mstar::kv::cli::cmd_info, "print the engines built and a layout's sizes"},
    {"demo", &mstar::kv::cli::cmd_demo,
     "a prefill process hands a request's KV to a decode process"},
#if MSTAR_KV_CMD_SERVE_PULL  // -DMSTAR_KV_BUILD_SERVE_PULL (tools/CMakeLists.txt)
    {"serve", &mstar::kv::cli::cmd_serve, "hold caches and serve published sequences over HTTP"},
    {"pull", &mstar::kv::cli::cmd_pull, "pull a sequence from a serving host and verify it"},
#endif
    {"bench", &mstar::kv::cli::cmd_bench, "measure every engine against its baseline"},
    {"soak", &mstar::kv::cli::cmd_soak, "pull under injected faults and count corruptions"},
};

void usage(std::FILE* out) {
  std::fprintf(out, "usage: mstar-kv COMMAND [options]   (mstar-kv COMMAND --help)\n\ncommands:\n");
  for (const Entry& e : kCommands) std::fprintf(out, "  %-6s %s\n", e.name, e.help);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  // The CLI logs to stderr (the library's Logger::from_env, which every
  // EngineOptions starts from): warn unless MSTAR_KV_LOG says otherwise.
  // Set before any thread starts; child processes inherit it.
  ::setenv("MSTAR_KV_LOG", "warn", /*overwrite=*/0);
  for (const Entry& e : kCommands) {
    if (std::strcmp(argv[1], e.name) == 0) {
      try {
        return e.run(argc - 2, argv + 2);
      } catch (const mstar::kv::Error& err) {
        std::fprintf(stderr, "mstar-kv %s: error: %s\n", e.name, err.what());
        return err.code() == mstar::kv::StatusCode::kInvalidArgument ? 2 : 1;
      } catch (const std::exception& err) {
        std::fprintf(stderr, "mstar-kv %s: error: %s\n", e.name, err.what());
        return 1;
      }
    }
  }
  std::fprintf(stderr, "mstar-kv: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
