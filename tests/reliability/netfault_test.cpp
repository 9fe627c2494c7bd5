// Copyright mstar-kv authors.
//
// A faulty network between two hosts: `mstar-kv serve` (the
// owner; engine ucx over its tcp transport) in network namespace A,
// net_reader (the decode side, net_reader.cpp) in namespace B, and a fault
// between them:
//   - random loss (1%, 5%) and partitions: nftables rules in B, on its link;
//   - a bandwidth cap: a tbf qdisc on the owner's link;
//   - delay, jitter, stalls and connection resets: net_relay (net_relay.cpp)
//     in a third namespace R that routes between A and B, where an nft rule
//     hands it every TCP connection (control plane and UCX alike).
// What every case checks: each pull verifies every block byte for byte, or
// fails within its timeout (plus slack) with a clear error; after a failed
// pull no byte lands (net_reader compares its cache after a grace period
// with a copy taken when the future failed: `late` must be 0); the owner
// still runs after the fault; a pull after the heal succeeds in the same
// reader; and at the end a fresh `mstar-kv pull` succeeds and the owner
// exits cleanly (--exit-when-done).
// Skips, with the reason, where `ip netns add` is refused or nft or tc
// is missing (the scripts install nftables; CI runs as root).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/netns.hpp"
#include "toolkit/child.hpp"

#ifndef MSTAR_KV_CLI_PATH
#error "MSTAR_KV_CLI_PATH must name the mstar-kv executable"
#endif

namespace mstar::kv::testing {
namespace {

using namespace std::chrono_literals;
using Shape = NetNamespaces::Shape;

constexpr int kHttpPort = 23480;  // the namespaces are this test's own: no clash
constexpr int kRelayPort = 15000;
constexpr double kSlackMs = 2000;  // on top of a read's timeout, for a loaded machine

// One line of net_reader's about a pull.
struct Pull {
  std::string kind;  // OK, FAIL, CORRUPT (or what else came)
  double ms = -1;
  std::string code;
  int landed = -1;
  long long late = -1;
  std::string line;
};

std::string field(const std::string& line, const std::string& key) {
  const auto at = line.find(" " + key + "=");
  if (at == std::string::npos) return "";
  const auto from = at + key.size() + 2;
  return line.substr(from, line.find(' ', from) - from);
}

Pull parse_pull(const std::string& line) {
  Pull p;
  p.line = line;
  p.kind = line.substr(0, line.find(' '));
  if (const auto ms = field(line, "ms"); !ms.empty()) p.ms = std::stod(ms);
  p.code = field(line, "code");
  if (const auto l = field(line, "landed"); !l.empty()) p.landed = std::stoi(l);
  if (const auto l = field(line, "late"); !l.empty()) p.late = std::stoll(l);
  return p;
}

// The hosts, the owner, the reader and (routed) the relay of one case.
class Hosts {
 public:
  explicit Hosts(Shape shape) : shape_(shape), ns_(shape, "nf") {
    if (!ns_.skip_reason().empty()) {
      reason_ = ns_.skip_reason();
    } else if (run_shell("nft --version") != 0) {
      reason_ = "nft (Debian's nftables) is not installed";
    } else if (run_shell("tc -V") != 0) {
      reason_ = "tc (iproute2) is not installed";
    }
    // Wire-sized packets (no 64 KiB GSO super-packets on the veth links), so
    // that "5% of packets" means what it means on a real link.
    if (reason_.empty()) {
      for (const auto& [n, dev] :
           {std::pair{ns_.ns_a(), ns_.veth_a()}, {ns_.ns_b(), ns_.veth_b()}}) {
        if (run_shell("ip -n " + n + " link set dev " + dev + " gso_max_segs 1") != 0) {
          reason_ = "cannot set gso_max_segs on the veth links (iproute2 too old?)";
        }
      }
    }
    token_ = ::testing::TempDir() + "/netfault_token" + std::to_string(::getpid());
    std::ofstream(token_) << "netfault-shared-secret-0123456789\n";
  }
  ~Hosts() {
    if (reader_) reader_->kill_and_reap(1000ms);
    if (relay_) relay_->kill_and_reap(1000ms);
    if (serve_) serve_->kill_and_reap(2000ms);
  }
  const std::string& skip_reason() const { return reason_; }
  const NetNamespaces& ns() const { return ns_; }
  const std::string& token() const { return token_; }
  std::string http() const { return ns_.addr_a() + ":" + std::to_string(kHttpPort); }

  // The owner: one sequence of `tokens` tokens x `layers` layers (32 KiB a
  // token at 8 layers), never freed until a reader marks it done.
  void start_owner(int tokens, int layers) {
    serve_ = std::make_unique<toolkit::Child>(
        ns_.in_a({MSTAR_KV_CLI_PATH, "serve", "--engine", "ucx", "--listen", http(), "--token-file",
                  token_, "--sequences", "1", "--tokens", std::to_string(tokens), "--layers",
                  std::to_string(layers), "--lease-ms", "0", "--exit-when-done"}),
        tcp_env(ns_.veth_a()));
    ASSERT_TRUE(serve_->wait_for_output("/v1/sequences/", 30s)) << serve_->output();
  }

  // The relay in R, and the rule that hands it every TCP connection R routes.
  // Without stand-ins, R is a NAT that does not forward connections to its
  // own addresses.
  void start_relay(bool stand_ins = true) {
    std::vector<std::string> argv = {NET_RELAY_PATH, std::to_string(kRelayPort)};
    if (stand_ins) {
      argv.insert(argv.end(), {"--stand-in", ns_.router_a() + "=" + ns_.addr_b(), "--stand-in",
                               ns_.router_b() + "=" + ns_.addr_a()});
    }
    relay_ = std::make_unique<toolkit::Child>(ns_.in_r(argv), std::map<std::string, std::string>{},
                                              false);
    ASSERT_EQ(relay_->read_line(10s), "READY");
    ASSERT_EQ(nft(ns_.ns_r(),
                  "table ip nfrelay {\n"
                  "  chain pre {\n"
                  "    type nat hook prerouting priority dstnat; policy accept;\n"
                  "    ip protocol tcp redirect to :" +
                      std::to_string(kRelayPort) + "\n  }\n}\n"),
              0);
  }
  std::string relay(const std::string& cmd) {
    relay_->write_line(cmd);
    return relay_->read_line(10s);
  }
  // Bytes the relay forwarded so far (both directions).
  long long relayed_bytes() {
    const std::string s = relay("stats");
    const auto at = s.find(" bytes ");
    return at == std::string::npos ? -1 : std::stoll(s.substr(at + 7));
  }

  void start_reader(int timeout_ms, int grace_ms) {
    timeout_ms_ = timeout_ms;
    grace_ms_ = grace_ms;
    reader_ = std::make_unique<toolkit::Child>(
        ns_.in_b({NET_READER_PATH, "--from", http(), "--seq", "0", "--timeout-ms",
                  std::to_string(timeout_ms), "--grace-ms", std::to_string(grace_ms),
                  "--token-file", token_}),
        tcp_env(ns_.veth_b()), false);
    const std::string ready = reader_->read_line(30s);
    ASSERT_EQ(ready.rfind("READY ", 0), 0u) << ready;
  }

  // The start of the cases that strike a read in its middle: the owner of
  // 16 MiB (512 tokens x 8 layers), the relay where routed, a 300 Mbit/s cap
  // on the owner's link (a read then lasts about half a second, so that the
  // fault lands in its middle however fast this machine is), the reader.
  void start_capped(int timeout_ms, int grace_ms) {
    ASSERT_NO_FATAL_FAILURE(start_owner(512, 8));
    if (shape_ == Shape::kRouted) {
      ASSERT_NO_FATAL_FAILURE(start_relay());
    }
    ASSERT_EQ(cap_a("300mbit"), 0) << "tbf refused";
    ASSERT_NO_FATAL_FAILURE(start_reader(timeout_ms, grace_ms));
  }

  // One pull; with `at_pct` > 0, `fault` runs once about that much of the
  // cache holds bytes (the read is then in its middle).
  Pull pull(int at_pct = 0, const std::function<void()>& fault = {}) {
    reader_->write_line("pull " + std::to_string(at_pct));
    EXPECT_EQ(reader_->read_line(30s), "STARTED");
    const auto budget = std::chrono::milliseconds(timeout_ms_ + grace_ms_ + 30000);
    std::string line = reader_->read_line(budget);
    if (at_pct > 0) {
      if (line.rfind("LANDED", 0) != 0) {
        ADD_FAILURE() << "the pull ended before the fault could strike: " << line;
        return parse_pull(line);
      }
      fault();
      line = reader_->read_line(budget);
    }
    return parse_pull(line);
  }

  // One pull that must verify, printed after `what`.
  Pull pull_ok(const std::string& what) {
    const Pull p = pull();
    std::printf("%s: %s\n", what.c_str(), p.line.c_str());
    EXPECT_EQ(p.kind, "OK") << what << ": " << p.line;
    return p;
  }

  // One pull through an outage of `length`: about a quarter into the read,
  // `cut` starts it (a partition, a stall) and `mend` ends it `length` later,
  // from another thread; returns, printed after `what`, once both the pull
  // and the outage ended.
  Pull pull_through_outage(const std::string& what, std::chrono::milliseconds length,
                           const std::function<void()>& cut, const std::function<void()>& mend) {
    std::thread mender;
    const Pull p = pull(25, [&] {
      cut();
      if (::testing::Test::HasFatalFailure()) return;
      mender = std::thread([&] {
        std::this_thread::sleep_for(length);
        mend();
      });
    });
    if (mender.joinable()) mender.join();
    std::printf("%s: %s\n", what.c_str(), p.line.c_str());
    return p;
  }
  // Every packet on B's link dropped for `length`.
  Pull pull_through_partition(const std::string& what, std::chrono::milliseconds length) {
    return pull_through_outage(
        what, length, [&] { ASSERT_EQ(fault_b("drop"), 0); }, [&] { EXPECT_EQ(heal_b(), 0); });
  }
  // The relay forwarding nothing for `length` (TCP pushes back on both ends).
  Pull pull_through_stall(const std::string& what, std::chrono::milliseconds length) {
    return pull_through_outage(
        what, length, [&] { ASSERT_EQ(relay("stall"), "OK stall"); },
        [&] { EXPECT_EQ(relay("resume"), "OK resume"); });
  }

  // A pull an outage longer than the timeout cut in its middle: it failed
  // cleanly (expect_clean_failure) after part of the cache landed, the owner
  // survived, and the same reader pulls again (printed after `after`).
  void expect_cut_mid_read(const Pull& cut, const std::string& after) {
    expect_clean_failure(cut, {"Timeout", "PeerFailure"});
    EXPECT_GT(cut.landed, 0) << "the outage did not cut the read in its middle";
    EXPECT_LT(cut.landed, 100) << "the outage did not cut the read in its middle";
    EXPECT_TRUE(owner_alive());
    pull_ok(after);
  }

  // The checks of a pull that must have failed: bounded, clear, nothing late.
  void expect_clean_failure(const Pull& p, const std::vector<std::string>& codes) {
    EXPECT_EQ(p.kind, "FAIL") << p.line;
    EXPECT_LE(p.ms, timeout_ms_ + kSlackMs) << p.line;
    EXPECT_EQ(p.late, 0) << "bytes landed after the failed future: " << p.line;
    EXPECT_NE(p.line.find(" error="), std::string::npos) << p.line;
    EXPECT_GT(p.line.size() - p.line.find(" error="), 10u) << "no message: " << p.line;
    bool known = false;
    for (const auto& c : codes) known = known || p.code == c;
    EXPECT_TRUE(known) << "unexpected status: " << p.line;
  }

  bool owner_alive() { return serve_ && !serve_->wait_for(0ms).has_value(); }
  const std::string& owner_output() const { return serve_->output(); }

  // The end of every case: the reader quits, a fresh `mstar-kv pull` in B
  // verifies every page and marks the sequence done, and the owner (alive
  // until then) exits by itself, cleanly.
  void finish() {
    ASSERT_TRUE(owner_alive()) << serve_->output();
    reader_->write_line("quit");
    EXPECT_EQ(reader_->wait_exit(20s), 0);
    toolkit::Child pull(ns_.in_b({MSTAR_KV_CLI_PATH, "pull", "--from", http(), "--seq", "0",
                                  "--token-file", token_, "--timeout-ms", "30000"}),
                        tcp_env(ns_.veth_b()));
    ASSERT_EQ(pull.wait_exit(60s), 0) << pull.output();
    EXPECT_NE(pull.output().find("every page verified"), std::string::npos) << pull.output();
    EXPECT_EQ(serve_->wait_exit(30s), 0) << serve_->output();
    EXPECT_NE(serve_->output().find("all sequences done"), std::string::npos) << serve_->output();
  }

  // nftables: a ruleset into namespace ns; 0 on success.
  static int nft(const std::string& ns, const std::string& ruleset) {
    return run_shell_with_input("ip netns exec " + ns + " nft -f -", ruleset);
  }
  // Drops packets on B's link, both ways: `verdict` is "drop" (a partition)
  // or e.g. "numgen random mod 100 < 5 drop" (5% loss).
  int fault_b(const std::string& verdict) {
    const std::string& dev = ns_.veth_b();
    return nft(ns_.ns_b(),
               "table inet nffault {\n"
               "  chain in {\n    type filter hook input priority 0; policy accept;\n"
               "    iifname \"" +
                   dev +
                   "\" counter\n"
                   "    iifname \"" +
                   dev + "\" " + verdict +
                   "\n  }\n"
                   "  chain out {\n    type filter hook output priority 0; policy accept;\n"
                   "    oifname \"" +
                   dev +
                   "\" counter\n"
                   "    oifname \"" +
                   dev + "\" " + verdict + "\n  }\n}\n");
  }
  int heal_b() { return NetNamespaces::exec(ns_.ns_b(), "nft delete table inet nffault"); }
  // A tbf cap on the owner's link (what the owner sends: the data).
  int cap_a(const std::string& rate) {
    return run_shell("tc -n " + ns_.ns_a() + " qdisc replace dev " + ns_.veth_a() +
                     " root tbf rate " + rate + " burst 64kb latency 200ms");
  }
  int uncap_a() {
    return run_shell("tc -n " + ns_.ns_a() + " qdisc del dev " + ns_.veth_a() + " root");
  }
  // Packets on B's link and those the fault rule dropped, so far (the
  // rules' counters: every packet, then the dropped ones, per direction).
  std::pair<long long, long long> seen_and_dropped_b() {
    toolkit::Child list(NetNamespaces::in(ns_.ns_b(), {"nft", "list", "table", "inet", "nffault"}));
    const std::string out = list.read_all(10s);
    long long n[2] = {0, 0};
    int i = 0;
    for (std::size_t at = out.find("packets "); at != std::string::npos;
         at = out.find("packets ", at + 1)) {
      n[i++ % 2] += std::stoll(out.substr(at + 8));
    }
    return {n[0], n[1]};
  }

 private:
  static std::map<std::string, std::string> tcp_env(const std::string& dev) {
    return {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", dev}};
  }

  Shape shape_;
  NetNamespaces ns_;
  std::string reason_, token_;
  std::unique_ptr<toolkit::Child> serve_, relay_, reader_;
  int timeout_ms_ = 0, grace_ms_ = 0;
};

#define NETFAULT_SETUP(hosts) \
  if (!(hosts).skip_reason().empty()) GTEST_SKIP() << (hosts).skip_reason()

// Loss: TCP retransmits under the engine; every pull must verify.
void pulls_under_loss(int percent) {
  Hosts h(Shape::kPair);
  NETFAULT_SETUP(h);
  ASSERT_NO_FATAL_FAILURE(h.start_owner(256, 8));  // 8 MiB: 2-3 s a pull at 5% loss
  ASSERT_NO_FATAL_FAILURE(h.start_reader(30000, 1000));
  ASSERT_EQ(h.fault_b("numgen random mod 100 < " + std::to_string(percent) + " counter drop"), 0);
  for (int i = 0; i < 3; ++i) {
    h.pull_ok(std::to_string(percent) + "% loss, pull " + std::to_string(i + 1));
  }
  // The CLI's own pull under the same loss (--keep: the sequence stays).
  toolkit::Child cli(h.ns().in_b({MSTAR_KV_CLI_PATH, "pull", "--from", h.http(), "--seq", "0",
                                  "--token-file", h.token(), "--repeat", "2", "--keep"}),
                     {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", h.ns().veth_b()}});
  EXPECT_EQ(cli.wait_exit(120s), 0) << cli.output();
  EXPECT_NE(cli.output().find("every page verified"), std::string::npos) << cli.output();
  const auto [seen, dropped] = h.seen_and_dropped_b();
  std::printf("%d%% loss: %lld of %lld packets dropped\n", percent, dropped, seen);
  // The rule did drop about that share (binomial: far inside these bounds).
  EXPECT_GT(dropped * 100, seen * percent / 2) << dropped << " of " << seen;
  EXPECT_LT(dropped * 100, seen * percent * 2) << dropped << " of " << seen;
  ASSERT_EQ(h.heal_b(), 0);
  h.pull_ok(std::to_string(percent) + "% loss, healed");
  h.finish();
}

TEST(NetFault, OnePercentLossEveryPullVerifies) { pulls_under_loss(1); }
TEST(NetFault, FivePercentLossEveryPullVerifies) { pulls_under_loss(5); }

// A tbf cap on the owner's link: pulls verify and take at least the time
// the cap allows (so the data did cross the capped link); under a cap too
// low for the reader's timeout, the pull fails in time, nothing lands late,
// and once the cap is lifted the same reader pulls again.
TEST(NetFault, BandwidthCapSlowsPullsAndATooLowCapTimesOutCleanly) {
  Hosts h(Shape::kPair);
  NETFAULT_SETUP(h);
  ASSERT_NO_FATAL_FAILURE(h.start_owner(512, 8));  // 16 MiB
  ASSERT_NO_FATAL_FAILURE(h.start_reader(3000, 3000));
  ASSERT_EQ(h.cap_a("200mbit"), 0) << "tbf refused";
  const double floor_ms = 16.0 * 1048576 * 8 / 200e6 * 1e3 * 0.9;  // 90% of 671 ms
  for (int i = 0; i < 2; ++i) {
    const Pull p = h.pull_ok("200 Mbit/s cap");
    EXPECT_GE(p.ms, floor_ms) << "faster than the cap allows: " << p.line;
  }
  ASSERT_EQ(h.cap_a("20mbit"), 0);  // 16 MiB need 6.7 s; the timeout is 3 s
  const Pull slow = h.pull();
  std::printf("20 Mbit/s cap, 3 s timeout: %s\n", slow.line.c_str());
  h.expect_clean_failure(slow, {"Timeout"});
  EXPECT_TRUE(h.owner_alive());
  ASSERT_EQ(h.uncap_a(), 0);
  h.pull_ok("cap lifted");
  h.finish();
}

// A partition (every packet on B's link dropped) in the middle of a read.
// Longer than the reader's timeout: the read fails in time, and the
// partition heals while net_reader still watches its cache (TCP then
// delivers what it held back: none of it may land). Shorter than the
// timeout: the read survives it and verifies.
TEST(NetFault, PartitionMidReadFailsInTimeThenHealsAndPullsAgain) {
  Hosts h(Shape::kPair);
  NETFAULT_SETUP(h);
  ASSERT_NO_FATAL_FAILURE(h.start_capped(3000, 6000));
  // 4 s: past the timeout, inside the grace period.
  const Pull cut = h.pull_through_partition("4 s partition at 25%, 3 s timeout", 4s);
  h.expect_cut_mid_read(cut, "after the heal");
  h.finish();
}

TEST(NetFault, PartitionShorterThanTheTimeoutIsRiddenOut) {
  Hosts h(Shape::kPair);
  NETFAULT_SETUP(h);
  ASSERT_NO_FATAL_FAILURE(h.start_capped(15000, 1000));
  const Pull p = h.pull_through_partition("1.5 s partition at 25%, 15 s timeout", 1500ms);
  EXPECT_EQ(p.kind, "OK") << p.line;
  EXPECT_GE(p.ms, 1500) << p.line;
  h.finish();
}

// Through net_relay: delay and jitter (per chunk, order kept per
// direction): every pull verifies, and the relay carried the data (UCX's
// tcp connections, not only the control plane).
TEST(NetFault, RelayDelayAndJitterEveryPullVerifies) {
  Hosts h(Shape::kRouted);
  NETFAULT_SETUP(h);
  ASSERT_NO_FATAL_FAILURE(h.start_owner(512, 8));  // 16 MiB
  ASSERT_NO_FATAL_FAILURE(h.start_relay());
  ASSERT_EQ(h.relay("delay 20 15"), "OK delay");
  ASSERT_NO_FATAL_FAILURE(h.start_reader(30000, 1000));
  const long long before = h.relayed_bytes();
  for (int i = 0; i < 3; ++i) {
    const Pull p = h.pull_ok("relay delay 20 +- 15 ms");
    EXPECT_GE(p.ms, 10) << "faster than one relayed round trip: " << p.line;
  }
  EXPECT_GE(h.relayed_bytes() - before, 3LL * 16 * 1048576) << "the data bypassed the relay";
  std::printf("%s\n", h.relay("stats").c_str());
  h.finish();
}

// A stall (the relay forwards nothing; TCP pushes back on both ends) in the
// middle of a read: shorter than the timeout, the read rides it out; longer,
// it fails in time and what the relay then forwards (the failed read's
// bytes) does not land.
TEST(NetFault, RelayStallMidRead) {
  Hosts h(Shape::kRouted);
  NETFAULT_SETUP(h);
  ASSERT_NO_FATAL_FAILURE(h.start_capped(3000, 3000));
  const Pull ridden = h.pull_through_stall("1 s stall at 25%, 3 s timeout", 1000ms);
  EXPECT_EQ(ridden.kind, "OK") << ridden.line;
  const Pull cut = h.pull_through_stall("4 s stall at 25%, 3 s timeout", 4000ms);
  h.expect_cut_mid_read(cut, "after the stall");
  h.finish();
}

// Every connection reset (RST to both ends) in the middle of a read: the
// read fails (the peer is gone, not a timeout's wait), nothing lands late,
// the owner survives its reader's connections dying under its replies,
// and the same reader reconnects and pulls.
TEST(NetFault, RelayResetMidReadFailsThenReconnects) {
  Hosts h(Shape::kRouted);
  NETFAULT_SETUP(h);
  ASSERT_NO_FATAL_FAILURE(h.start_capped(5000, 2000));
  for (int round = 0; round < 2; ++round) {
    const Pull cut = h.pull(25, [&] { ASSERT_EQ(h.relay("reset"), "OK reset"); });
    std::printf("reset at 25%%, round %d: %s\n", round + 1, cut.line.c_str());
    h.expect_clean_failure(cut, {"PeerFailure", "Timeout"});
    EXPECT_TRUE(h.owner_alive());
    h.pull_ok("after the reset");
  }
  std::printf("%s\n", h.relay("stats").c_str());
  h.finish();
}

// A reader behind a NAT: the owner sees its connections come from the
// router's address, where nothing forwards them back. Pulls may fail (the
// owner's tcp transport cannot connect back), but the owner must survive.
// DISABLED: UCX 1.13's owner retries that address 25 times and then aborts
// on an assertion in its progress (tcp_ep.c:478), killing the owner
// (docs/reliability-network.md, "Noticed"). A reproducer for whoever
// fixes it: --gtest_also_run_disabled_tests.
TEST(NetFault, DISABLED_OwnerSurvivesAReaderBehindANat) {
  Hosts h(Shape::kRouted);
  NETFAULT_SETUP(h);
  ASSERT_NO_FATAL_FAILURE(h.start_owner(64, 8));
  ASSERT_NO_FATAL_FAILURE(h.start_relay(false));
  ASSERT_NO_FATAL_FAILURE(h.start_reader(5000, 500));
  for (int i = 0; i < 3; ++i) {
    const Pull p = h.pull();
    std::printf("behind a NAT, pull %d: %s\n", i + 1, p.line.c_str());
    EXPECT_TRUE(p.kind == "OK" || p.kind == "FAIL") << p.line;
  }
  std::this_thread::sleep_for(5s);  // the owner's retries run out meanwhile
  EXPECT_TRUE(h.owner_alive()) << h.owner_output();
}

}  // namespace
}  // namespace mstar::kv::testing
