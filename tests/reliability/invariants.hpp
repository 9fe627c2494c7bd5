// Copyright mstar-kv authors.
//
// Invariant checks shared by the reliability tests (and usable by any engine
// test): the read checker (src/toolkit/read_check.hpp: no byte outside a
// read's destination spans changes, none after a failed read resolved, the
// future resolves in time), and that nothing is left in /dev/shm and no file
// descriptor leaked.
#pragma once

#include <dirent.h>

#include <cstring>
#include <set>
#include <string>

#include "toolkit/read_check.hpp"

namespace mstar::kv::testing {

// The read checker is the kit's (the soak uses it too).
using toolkit::allowed_ranges;
using toolkit::ReadChecker;

// Names in /dev/shm and the number of open file descriptors of this process,
// to compare before and after.
struct ResourceSnapshot {
  std::set<std::string> shm;
  std::size_t fds = 0;

  static ResourceSnapshot take() {
    ResourceSnapshot s;
    s.shm = list_dir("/dev/shm");
    s.fds = list_dir("/proc/self/fd").size();
    return s;
  }

  // "" when no /dev/shm entry was added and no descriptor leaked (entries
  // others created at the same time would show up too: tests that run in
  // parallel filter by their own prefix).
  std::string leaks_since(const ResourceSnapshot& before, const std::string& prefix = "") const {
    std::string out;
    for (const auto& n : shm) {
      if (before.shm.count(n) == 0 && n.rfind(prefix, 0) == 0) out += " /dev/shm/" + n;
    }
    if (fds > before.fds) {
      out += " " + std::to_string(fds - before.fds) + " more open file descriptors";
    }
    return out;
  }

 private:
  static std::set<std::string> list_dir(const char* path) {
    std::set<std::string> names;
    if (DIR* d = ::opendir(path)) {
      while (dirent* e = ::readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
          names.insert(e->d_name);
        }
      }
      ::closedir(d);
    }
    return names;
  }
};

}  // namespace mstar::kv::testing
