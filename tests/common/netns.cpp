// Copyright mstar-kv authors.
#include "common/netns.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace mstar::kv::testing {

namespace {

int exit_status(int rc) { return rc != -1 && WIFEXITED(rc) ? WEXITSTATUS(rc) : 128; }

}  // namespace

int run_shell(const std::string& cmd) {
  return exit_status(std::system(("timeout 20 " + cmd + " >/dev/null 2>&1").c_str()));
}

int run_shell_with_input(const std::string& cmd, const std::string& input) {
  FILE* p = ::popen(("timeout 20 " + cmd + " >/dev/null 2>&1").c_str(), "w");
  if (p == nullptr) return 128;
  std::fwrite(input.data(), 1, input.size(), p);
  return exit_status(::pclose(p));
}

std::vector<std::string> NetNamespaces::in(const std::string& ns, std::vector<std::string> argv) {
  argv.insert(argv.begin(), {"ip", "netns", "exec", ns});
  return argv;
}

int NetNamespaces::exec(const std::string& ns, const std::string& cmd) {
  return run_shell("ip netns exec " + ns + " " + cmd);
}

NetNamespaces::NetNamespaces(Shape shape, const std::string& prefix) {
  const std::string pid = std::to_string(::getpid());
  const char* letters[3] = {"A", "B", "R"};
  const int count = shape == Shape::kRouted ? 3 : 2;
  for (int i = 0; i < count; ++i) {
    ns_[i] = prefix + letters[i] + pid;
    if (run_shell("ip netns add " + ns_[i]) != 0) {
      reason_ = i == 0 ? "cannot create a network namespace (`ip netns add` failed: not root, "
                         "or no CAP_SYS_ADMIN here)"
                       : "cannot create a second network namespace";
      return;
    }
    made_[i] = true;
  }
  veth_a_ = prefix + "a" + pid;
  veth_b_ = prefix + "b" + pid;
  std::vector<std::string> steps;
  if (shape == Shape::kPair) {
    addr_a_ = "10.231.1.1";
    addr_b_ = "10.231.1.2";
    steps = {"ip link add " + veth_a_ + " type veth peer name " + veth_b_,
             "ip link set " + veth_a_ + " netns " + ns_a(),
             "ip link set " + veth_b_ + " netns " + ns_b(),
             "ip -n " + ns_a() + " addr add 10.231.1.1/24 dev " + veth_a_,
             "ip -n " + ns_b() + " addr add 10.231.1.2/24 dev " + veth_b_};
  } else {
    // Both sides' peers live in R; the hosts route everything through R.
    addr_a_ = "10.231.1.1";
    addr_b_ = "10.231.2.1";
    const std::string ra = prefix + "x" + pid, rb = prefix + "y" + pid;
    steps = {"ip link add " + veth_a_ + " type veth peer name " + ra,
             "ip link add " + veth_b_ + " type veth peer name " + rb,
             "ip link set " + veth_a_ + " netns " + ns_a(),
             "ip link set " + veth_b_ + " netns " + ns_b(),
             "ip link set " + ra + " netns " + ns_r(),
             "ip link set " + rb + " netns " + ns_r(),
             "ip -n " + ns_a() + " addr add 10.231.1.1/24 dev " + veth_a_,
             "ip -n " + ns_b() + " addr add 10.231.2.1/24 dev " + veth_b_,
             "ip -n " + ns_r() + " addr add 10.231.1.2/24 dev " + ra,
             "ip -n " + ns_r() + " addr add 10.231.2.2/24 dev " + rb,
             "ip -n " + ns_r() + " link set " + ra + " up",
             "ip -n " + ns_r() + " link set " + rb + " up",
             "ip -n " + ns_r() + " link set lo up",
             "ip netns exec " + ns_r() + " sysctl -qw net.ipv4.ip_forward=1"};
  }
  steps.insert(steps.end(),
               {"ip -n " + ns_a() + " link set " + veth_a_ + " up",
                "ip -n " + ns_b() + " link set " + veth_b_ + " up",
                "ip -n " + ns_a() + " link set lo up", "ip -n " + ns_b() + " link set lo up"});
  if (shape == Shape::kRouted) {
    steps.insert(steps.end(), {"ip -n " + ns_a() + " route add default via 10.231.1.2",
                               "ip -n " + ns_b() + " route add default via 10.231.2.2"});
  }
  setup(steps);
}

bool NetNamespaces::setup(const std::vector<std::string>& steps) {
  for (const auto& s : steps) {
    if (run_shell(s) != 0) {
      reason_ = "cannot set up the namespaces' links: `" + s + "` failed";
      return false;
    }
  }
  return true;
}

NetNamespaces::~NetNamespaces() {
  for (int i = 2; i >= 0; --i) {
    if (made_[i]) run_shell("ip netns del " + ns_[i]);  // deletes its veth ends too
  }
}

}  // namespace mstar::kv::testing
