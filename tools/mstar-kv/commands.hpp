// Copyright mstar-kv authors.
//
// Subcommands of the mstar-kv CLI. Each takes the arguments after its name
// and returns the process exit code (0 success, 1 failure, 2 usage error).
#pragma once

namespace mstar::kv::cli {

int cmd_info(int argc, char** argv);
int cmd_demo(int argc, char** argv);
int cmd_serve(int argc, char** argv);
int cmd_pull(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_soak(int argc, char** argv);

}  // namespace mstar::kv::cli
