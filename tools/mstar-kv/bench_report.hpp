// Copyright mstar-kv authors.
//
// How `mstar-kv bench` shows its results: a live progress bar on a
// terminal, the table at the end, JSON, CSV and an SVG plot of bandwidth
// against piece size. Not thread-safe.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_workload.hpp"

namespace mstar::kv::cli::bench {

// A reference measured once per run (iperf3, ...), not tied to one case.
struct Reference {
  std::string name;  // "iperf3 tcp loopback"
  bool ok = false;
  double gbps = 0;
  std::string detail;  // the command, or why it did not run
};

struct Report {
  std::string tool = "mstar-kv bench";  // the program that measured
  std::string date;                     // UTC, ISO 8601
  unsigned nproc = 0;
  std::string suite;
  std::uint32_t threads = 0;
  std::uint32_t repeat = 0;
  double min_time_s = 0;
  std::vector<std::string> engines_built;
  std::vector<CaseResult> cases;  // measured, failed and skipped
  std::vector<Reference> references;
  std::vector<std::string> notes;  // e.g. why an engine or baseline was skipped
};

// Draws "[#####.....] 12/40 label" on stderr when enabled (a terminal).
class Progress {
 public:
  Progress(std::size_t total, bool enabled) : total_(total), enabled_(enabled) {}
  ~Progress() { finish(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void set_label(const std::string& label);  // the case being run
  void status(const std::string& what);      // "rep 2/3"
  void step();                               // one unit of work done
  void add_total(std::size_t n) { total_ += n; }
  void finish();  // clears the line

 private:
  void draw();
  std::size_t total_;
  std::size_t done_ = 0;
  bool enabled_;
  bool drawn_ = false;
  std::string label_;
  std::string status_;
};

// For every measured case of mixed geometry whose plain twin (NAME/plain,
// plain_twin) ran on the same engine: a note with the ratio of the two, and
// the twin's GB/s in the case's extra["plain_gbps"].
void note_plain_twins(Report& report);

// "64 KiB", "2 MiB", "100 B": a byte count as the notes write it.
std::string size_name(std::uint64_t bytes);

void print_table(std::FILE* out, const Report& report);
void write_json(std::FILE* out, const Report& report);
void write_csv(std::FILE* out, const Report& report);
// Bandwidth against piece size per engine (the "piece" sweep cases), each
// engine's baseline dashed in the same colour.
void write_svg(std::FILE* out, const Report& report);

}  // namespace mstar::kv::cli::bench
