// Copyright mstar-kv authors.
#include "mstar/kv/core/stats.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace mstar::kv {

void LatencyHistogram::add(double seconds) noexcept {
  if (seconds < 0) seconds = 0;
  const auto it = std::lower_bound(kBounds.begin(), kBounds.end(), seconds);
  ++buckets[static_cast<std::size_t>(it - kBounds.begin())];
  ++count;
  sum_seconds += seconds;
}

void LatencyHistogram::merge(const LatencyHistogram& o) noexcept {
  for (std::size_t i = 0; i < buckets.size(); ++i) buckets[i] += o.buckets[i];
  count += o.count;
  sum_seconds += o.sum_seconds;
}

std::uint64_t PeerStats::failed() const noexcept {
  std::uint64_t n = 0;
  for (auto v : reads_failed) n += v;
  return n;
}

void PeerStats::merge(const PeerStats& o) noexcept {
  reads_started += o.reads_started;
  reads_succeeded += o.reads_succeeded;
  for (std::size_t i = 0; i < reads_failed.size(); ++i) reads_failed[i] += o.reads_failed[i];
  bytes += o.bytes;
  copies += o.copies;
  for (std::size_t i = 0; i < latency.size(); ++i) latency[i].merge(o.latency[i]);
}

void ServedStats::merge(const ServedStats& o) noexcept {
  reads += o.reads;
  bytes += o.bytes;
  reads_refused += o.reads_refused;
  replies_dropped += o.replies_dropped;
  readers_connected += o.readers_connected;
  readers_gone += o.readers_gone;
  staged_bytes += o.staged_bytes;
  descriptors += o.descriptors;
  done_notices += o.done_notices;
}

PeerStats& TransferStatsRecorder::peer_locked(const std::string& peer) {
  return peers_[peer.empty() ? "unknown" : peer];
}

void TransferStatsRecorder::refused(const std::string& peer, StatusCode code, double plan_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  PeerStats& p = peer_locked(peer);
  ++p.reads_started;
  ++p.reads_failed[static_cast<std::size_t>(code)];
  p.latency[static_cast<std::size_t>(Phase::kPlan)].add(plan_seconds);
}

void TransferStatsRecorder::started(const std::string& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  ++peer_locked(peer).reads_started;
}

std::array<double, 3> phase_seconds(const TransferTiming& t,
                                    TransferTiming::Clock::time_point called,
                                    TransferTiming::Clock::time_point returned) {
  using secs = std::chrono::duration<double>;
  const auto planned = t.planned_marked ? t.planned : returned;
  const auto posted = t.posted_marked ? t.posted : std::max(planned, returned);
  const auto resolved = std::max(t.resolved, posted);
  return {secs(planned - called).count(), secs(posted - planned).count(),
          secs(resolved - posted).count()};
}

void TransferStatsRecorder::finished(const TransferTiming& t,
                                     TransferTiming::Clock::time_point called,
                                     TransferTiming::Clock::time_point returned,
                                     const Status& status, std::uint64_t bytes) {
  const std::array<double, 3> phases = phase_seconds(t, called, returned);
  std::lock_guard<std::mutex> lock(mu_);
  PeerStats& p = peer_locked(t.peer);
  if (status.is_ok()) {
    ++p.reads_succeeded;
    p.bytes += bytes;
  } else {
    ++p.reads_failed[static_cast<std::size_t>(status.code())];
  }
  p.copies += t.copies;
  for (std::size_t i = 0; i < phases.size(); ++i) p.latency[i].add(phases[i]);
}

std::optional<TransferFuture> TransferStatsRecorder::track(
    const std::shared_ptr<TransferStatsRecorder>& rec,
    const std::function<std::optional<TransferFuture>()>& issue) {
  using Clock = TransferTiming::Clock;
  const auto t0 = Clock::now();
  std::optional<TransferFuture> future;
  try {
    future = issue();
  } catch (const Error& e) {
    rec->refused("", e.code(), std::chrono::duration<double>(Clock::now() - t0).count());
    throw;
  }
  if (!future) return future;
  const auto returned = Clock::now();
  rec->started(future->timing().peer);
  // Planning before the engine's call (from t0) counts as the plan phase.
  // Before waiters wake: stats() right after get() counts this read.
  future->on_resolving([rec, f = *future, t0, returned](const Status& s, std::uint64_t bytes) {
    rec->finished(f.timing(), t0, returned, s, bytes);
  });
  return future;
}

TransferStats TransferStatsRecorder::snapshot() const {
  TransferStats s;
  s.engine = engine_;
  std::lock_guard<std::mutex> lock(mu_);
  s.peers = peers_;
  for (const auto& [name, p] : peers_) s.total.merge(p);
  return s;
}

namespace {

// Label values escape backslash, double quote and newline.
std::string escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string labels(const TransferStats& s, const std::string& peer, const std::string& more) {
  return "{engine=\"" + escape(s.engine) + "\",peer=\"" + escape(peer) + "\"" + more + "}";
}

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

}  // namespace

std::string render_prometheus(const std::vector<TransferStats>& stats, const std::string& extra) {
  std::ostringstream o;
  auto counter = [&](const char* name, const char* help, auto value) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " counter\n";
    for (const auto& s : stats) {
      for (const auto& [peer, p] : s.peers) {
        o << name << labels(s, peer, "") << ' ' << value(p) << '\n';
      }
    }
  };
  counter("mstar_kv_reads_started_total", "Reads started (one per start_async_retrieve).",
          [](const PeerStats& p) { return p.reads_started; });
  counter("mstar_kv_reads_succeeded_total", "Reads that moved every byte.",
          [](const PeerStats& p) { return p.reads_succeeded; });
  o << "# HELP mstar_kv_reads_failed_total Reads that failed, by status code.\n"
       "# TYPE mstar_kv_reads_failed_total counter\n";
  for (const auto& s : stats) {
    for (const auto& [peer, p] : s.peers) {
      for (std::size_t c = 0; c < p.reads_failed.size(); ++c) {
        if (p.reads_failed[c] == 0) continue;
        o << "mstar_kv_reads_failed_total"
          << labels(s, peer, ",code=\"" + std::string(to_string(static_cast<StatusCode>(c))) + "\"")
          << ' ' << p.reads_failed[c] << '\n';
      }
    }
  }
  counter("mstar_kv_transferred_bytes_total", "Bytes moved by reads that succeeded.",
          [](const PeerStats& p) { return p.bytes; });
  counter("mstar_kv_copies_total", "Byte ranges handed to the transport, after coalescing.",
          [](const PeerStats& p) { return p.copies; });
  o << "# HELP mstar_kv_read_phase_seconds Read latency by phase (plan: validate and plan; "
       "post: until the last byte range was handed over; transfer: until resolution).\n"
       "# TYPE mstar_kv_read_phase_seconds histogram\n";
  for (const auto& s : stats) {
    for (const auto& [peer, p] : s.peers) {
      for (std::size_t ph = 0; ph < p.latency.size(); ++ph) {
        const LatencyHistogram& h = p.latency[ph];
        const std::string phase = std::string(",phase=\"") + kPhaseNames[ph] + "\"";
        std::uint64_t cumulative = 0;
        for (std::size_t b = 0; b < h.buckets.size(); ++b) {
          cumulative += h.buckets[b];
          const std::string le =
              b < LatencyHistogram::kBounds.size() ? num(LatencyHistogram::kBounds[b]) : "+Inf";
          o << "mstar_kv_read_phase_seconds_bucket" << labels(s, peer, phase + ",le=\"" + le + "\"")
            << ' ' << cumulative << '\n';
        }
        o << "mstar_kv_read_phase_seconds_sum" << labels(s, peer, phase) << ' '
          << num(h.sum_seconds) << '\n';
        o << "mstar_kv_read_phase_seconds_count" << labels(s, peer, phase) << ' ' << h.count
          << '\n';
      }
    }
  }
  // The owner side: one series per snapshot (engine label only).
  auto served = [&](const char* name, const char* help, std::uint64_t ServedStats::*field) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " counter\n";
    for (const auto& s : stats) {
      o << name << "{engine=\"" << escape(s.engine) << "\"} " << s.served.*field << '\n';
    }
  };
  served("mstar_kv_served_reads_total", "Read requests this owner answered with every reply.",
         &ServedStats::reads);
  served("mstar_kv_served_bytes_total", "Bytes of replies this owner sent (completed).",
         &ServedStats::bytes);
  served("mstar_kv_served_reads_refused_total", "Read requests this owner refused before any byte.",
         &ServedStats::reads_refused);
  served("mstar_kv_served_replies_dropped_total",
         "Replies and verdicts not sent because the reader was gone.",
         &ServedStats::replies_dropped);
  served("mstar_kv_served_readers_connected_total", "Reader connections accepted.",
         &ServedStats::readers_connected);
  served("mstar_kv_served_readers_gone_total", "Reader connections closed.",
         &ServedStats::readers_gone);
  served("mstar_kv_served_staged_bytes_total",
         "Bytes of replies this owner gathered into host buffers first (staging).",
         &ServedStats::staged_bytes);
  served("mstar_kv_served_descriptors_total",
         "SequenceInfo descriptors published by the served pool.", &ServedStats::descriptors);
  served("mstar_kv_served_done_notices_total", "Done notices the served pool took.",
         &ServedStats::done_notices);
  o << extra;
  return o.str();
}

}  // namespace mstar::kv
