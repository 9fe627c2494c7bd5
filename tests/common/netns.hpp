// Copyright mstar-kv authors.
//
// Network namespaces for the multi-host tests: two "hosts" (namespaces A
// and B) joined by a veth pair, or routed through a third namespace R (a
// router: A - R - B, two veth pairs, forwarding on) where a test puts
// faults that need a process in the path (tests/reliability/net_relay.cpp).
//
// Names carry a prefix and this process's pid, so that tests of several
// helpers or runs can make namespaces at the same time; every namespace the
// constructor made is deleted by the destructor (with the veth pairs in it),
// however the test ends. Needs root (CAP_SYS_ADMIN / CAP_NET_ADMIN); where
// `ip netns add` is refused, skip_reason() says so and a test skips.
// Not thread-safe: one owner.
#pragma once

#include <string>
#include <vector>

namespace mstar::kv::testing {

// Runs `cmd` through /bin/sh, bounded (20 s), its output discarded; the exit
// status (128 when it did not exit normally).
int run_shell(const std::string& cmd);
// Same, with `input` on its stdin (e.g. an nft ruleset for `nft -f -`).
int run_shell_with_input(const std::string& cmd, const std::string& input);

class NetNamespaces {
 public:
  enum class Shape {
    kPair,    // A <-veth-> B, one /24
    kRouted,  // A <-veth-> R <-veth-> B, a /24 on each side, default routes via R
  };
  // prefix: a few letters naming the test (namespace and interface names are
  // prefix + letter + pid, at most 15 characters).
  NetNamespaces(Shape shape, const std::string& prefix);
  ~NetNamespaces();
  NetNamespaces(const NetNamespaces&) = delete;
  NetNamespaces& operator=(const NetNamespaces&) = delete;

  // Empty when the namespaces are up; else why not (the test skips).
  const std::string& skip_reason() const { return reason_; }

  const std::string& ns_a() const { return ns_[0]; }
  const std::string& ns_b() const { return ns_[1]; }
  const std::string& ns_r() const { return ns_[2]; }  // kRouted only
  // The hosts' addresses, and their interfaces (inside A and B).
  const std::string& addr_a() const { return addr_a_; }
  const std::string& addr_b() const { return addr_b_; }
  // kRouted: the router's address on A's side and on B's side.
  std::string router_a() const { return "10.231.1.2"; }
  std::string router_b() const { return "10.231.2.2"; }
  const std::string& veth_a() const { return veth_a_; }
  const std::string& veth_b() const { return veth_b_; }

  // argv run inside a namespace (ip netns exec NS argv...).
  std::vector<std::string> in_a(std::vector<std::string> argv) const { return in(ns_a(), argv); }
  std::vector<std::string> in_b(std::vector<std::string> argv) const { return in(ns_b(), argv); }
  std::vector<std::string> in_r(std::vector<std::string> argv) const { return in(ns_r(), argv); }
  static std::vector<std::string> in(const std::string& ns, std::vector<std::string> argv);
  // A shell command inside namespace ns; its exit status (run_shell).
  static int exec(const std::string& ns, const std::string& cmd);

 private:
  bool setup(const std::vector<std::string>& steps);

  std::string ns_[3];
  bool made_[3] = {false, false, false};
  std::string addr_a_, addr_b_, veth_a_, veth_b_, reason_;
};

}  // namespace mstar::kv::testing
