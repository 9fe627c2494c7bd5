// Copyright mstar-kv authors.
//
// `mstar-kv soak`'s decode processes (reader churn; private to the command):
// processes that pull published sequences like the decode threads, each
// with one decode thread and every check of soak_decode.cpp, and that the
// supervisor SIGKILLs at random, half of them inside a read. The owners
// must survive every one of them.
//
// The process (`mstar-kv soak --role decode ...`, run_soak_decode) learns
// what is published from lines on its stdin:
//   PUB <slot> <engine> <hex SequenceInfo>   a sequence of prefill <slot>
//   CLEAR <slot>                             prefill <slot> restarts
//   DIE                                      SIGKILL yourself inside the next read
// and writes on its stdout, every 20 ms, "STATS <requests> <ok> <failed>
// <rejected> <bytes verified>" (cumulative), and at once for each
// corruption "CORRUPT <1 if a wrong-sequence read, else 0> <what>".
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "args.hpp"
#include "soak_shared.hpp"
#include "toolkit/child.hpp"

namespace mstar::kv::cli::soak {

// The decode role: serves until its stdin closes (or it is killed).
int run_soak_decode(const Args& args);

class ReaderChurn {
 public:
  // `args`: what every decode process gets after "--role decode".
  ReaderChurn(std::size_t count, std::vector<std::string> args);
  ~ReaderChurn();
  ReaderChurn(const ReaderChurn&) = delete;
  ReaderChurn& operator=(const ReaderChurn&) = delete;

  // Starts every process (none while count is 0), telling each what
  // `shared` holds now.
  void start(Shared& shared);
  // What changed in the supervisor's slots, to every process.
  void clear(std::size_t slot);
  void publish(std::size_t slot, const std::string& engine, const std::vector<SequenceInfo>& seqs);
  // Reads their reports into `stats`; reaps and restarts those that ended
  // (told what `shared` holds). Returns how many ended (killed or not).
  std::size_t poll(Stats& stats, Shared& shared);
  // Kills one at random: asks it to SIGKILL itself inside its next read, or
  // SIGKILLs it now (each half of the time). Its end is counted by poll().
  void kill_one(std::mt19937_64& rng);
  // Stops them all (their last reports counted).
  void stop(Stats& stats);

  const ReaderCounts& counts() const noexcept { return counts_; }

 private:
  struct Reader {
    std::unique_ptr<toolkit::Child> child;
    bool asked_to_die = false;                                                // told DIE
    bool killed_now = false;                                                  // SIGKILLed by us
    std::uint64_t requests = 0, ok = 0, failed = 0, rejected = 0, bytes = 0;  // last STATS
    std::map<std::string, std::uint64_t> codes;                               // its failures
  };
  void start_one(Reader& r, Shared& shared);
  void publish_to(Reader& r, std::size_t slot, const std::string& engine,
                  const std::vector<SequenceInfo>& seqs);
  void send(Reader& r, const std::string& line);
  void read_lines(Reader& r, Stats& stats);
  void account(Reader& r, Stats& stats);  // adds its last STATS, once

  std::vector<std::string> args_;
  std::vector<Reader> readers_;
  ReaderCounts counts_;
};

}  // namespace mstar::kv::cli::soak
