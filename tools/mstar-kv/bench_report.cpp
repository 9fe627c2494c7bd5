// Copyright mstar-kv authors.
#include "bench_report.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

namespace mstar::kv::cli::bench {

namespace {

// `s` with each character that `escape` names replaced by its escape.
template <typename Escape>
std::string escaped(const std::string& s, Escape escape) {
  std::string o;
  for (const char c : s) {
    if (const char* e = escape(c)) {
      o += e;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      o += buf;
    } else {
      o += c;
    }
  }
  return o;
}

std::string json_str(const std::string& s) {
  return "\"" +
         escaped(s,
                 [](char c) -> const char* {
                   switch (c) {
                     case '"':
                       return "\\\"";
                     case '\\':
                       return "\\\\";
                     case '\n':
                       return "\\n";
                     case '\t':
                       return "\\t";
                     default:
                       return nullptr;
                   }
                 }) +
         "\"";
}

std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// Control characters other than these become \u00XX as in JSON (XML 1.0
// has no other way to carry them; a bench report has none).
std::string xml(const std::string& s) {
  return escaped(s, [](char c) -> const char* {
    switch (c) {
      case '<':
        return "&lt;";
      case '>':
        return "&gt;";
      case '&':
        return "&amp;";
      case '"':
        return "&quot;";
      case '\n':
        return "\n";
      case '\t':
        return "\t";
      default:
        return nullptr;
    }
  });
}

std::string size_label(double bytes) {
  char buf[32];
  if (bytes >= 1048576) {
    std::snprintf(buf, sizeof buf, "%g MiB", bytes / 1048576);
  } else if (bytes >= 1024) {
    std::snprintf(buf, sizeof buf, "%g KiB", bytes / 1024);
  } else {
    std::snprintf(buf, sizeof buf, "%g B", bytes);
  }
  return buf;
}

std::string status_of(const CaseResult& c) {
  return c.ok ? "ok" : (c.skipped ? "skipped" : "failed");
}

}  // namespace

// ---- progress ------------------------------------------------------------------

void Progress::set_label(const std::string& label) {
  label_ = label;
  status_.clear();
  draw();
}

void Progress::status(const std::string& what) {
  status_ = what;
  draw();
}

void Progress::step() {
  ++done_;
  draw();
}

void Progress::draw() {
  if (!enabled_) return;
  constexpr int kWidth = 24;
  const std::size_t total = std::max<std::size_t>(total_, 1);
  const int filled = static_cast<int>(kWidth * std::min(done_, total) / total);
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(kWidth, '.');
  std::string line = "[" + bar + "] " + std::to_string(done_) + "/" + std::to_string(total_) +
                     "  " + label_ + (status_.empty() ? "" : "  " + status_);
  if (line.size() > 118) line.resize(118);
  std::fprintf(stderr, "\r\033[K%s", line.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void Progress::finish() {
  if (drawn_) {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    drawn_ = false;
  }
}

// ---- table ---------------------------------------------------------------------

std::string size_name(std::uint64_t b) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b >= 1024 && b % 1024 == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

void note_plain_twins(Report& report) {
  for (CaseResult& c : report.cases) {
    if (!c.ok || !c.workload.mixed_geometry()) continue;
    for (const CaseResult& t : report.cases) {
      if (!t.ok || t.engine != c.engine || t.workload.name != c.workload.name + "/plain") continue;
      c.extra["plain_gbps"] = t.gbps.median;
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "%s %s: %.2f GB/s = %.2f of the same request without conversion (%.2f GB/s)",
                    c.engine.c_str(), c.workload.name.c_str(), c.gbps.median,
                    t.gbps.median > 0 ? c.gbps.median / t.gbps.median : 0.0, t.gbps.median);
      report.notes.push_back(buf);
    }
  }
}

void print_table(std::FILE* out, const Report& r) {
  std::fprintf(out, "%s  %s  %u cores  suite %s  threads %u  repeat %u\n", r.tool.c_str(),
               r.date.c_str(), r.nproc, r.suite.c_str(), r.threads, r.repeat);
  std::fprintf(out, "engines built:");
  for (const auto& e : r.engines_built) std::fprintf(out, " %s", e.c_str());
  std::fprintf(out, "\n\n");
  std::size_t cw = 4;
  for (const auto& c : r.cases) cw = std::max(cw, c.workload.name.size());
  std::fprintf(out, "%-18s %-*s %21s %9s %9s %9s %8s %8s %9s %8s %-26s %8s %6s\n", "engine",
               static_cast<int>(cw), "case", "GB/s med [min,max]", "req/s", "p50 us", "p99 us",
               "prep us", "post us", "xfer us", "copies", "baseline", "base GB/s", "ratio");
  for (const auto& c : r.cases) {
    if (!c.ok) continue;
    char gb[64];
    std::snprintf(gb, sizeof gb, "%.2f [%.2f,%.2f]", c.gbps.median, c.gbps.min, c.gbps.max);
    char base[32] = "-";
    if (c.baseline_gbps) std::snprintf(base, sizeof base, "%.2f", c.baseline_gbps->median);
    char ratio[32] = "-";
    if (c.ratio) std::snprintf(ratio, sizeof ratio, "%.2f", *c.ratio);
    auto phase = [](const std::optional<double>& v) {
      char b[32] = "-";
      if (v) std::snprintf(b, sizeof b, "%.1f", *v);
      return std::string(b);
    };
    std::fprintf(out, "%-18s %-*s %21s %9.0f %9.0f %9.0f %8s %8s %9s %8llu %-26s %8s %6s\n",
                 c.engine.c_str(), static_cast<int>(cw), c.workload.name.c_str(), gb,
                 c.requests_per_s, c.p50_us, c.p99_us, phase(c.prep_us).c_str(),
                 phase(c.post_us).c_str(), phase(c.transfer_us).c_str(),
                 static_cast<unsigned long long>(c.copies),
                 c.baseline_name.empty() ? "-" : c.baseline_name.c_str(), base, ratio);
  }
  bool epoch_header = false;
  for (const auto& c : r.cases) {
    const auto off = c.extra.find("gbps_no_epoch_check");
    if (!c.ok || off == c.extra.end()) continue;
    if (!epoch_header) {
      std::fprintf(out, "\npage epoch checks (--epoch-ab; on and off alternate in each case):\n");
      epoch_header = true;
    }
    const auto cost = c.extra.find("epoch_check_cost_pct");
    std::fprintf(out, "  %-18s %-*s on %.2f GB/s, off %.2f GB/s: cost %+.2f%%\n", c.engine.c_str(),
                 static_cast<int>(cw), c.workload.name.c_str(), c.gbps.median, off->second,
                 cost == c.extra.end() ? 0.0 : cost->second);
  }
  bool header = false;
  for (const auto& c : r.cases) {
    if (c.ok) continue;
    if (!header) std::fprintf(out, "\nnot measured:\n");
    header = true;
    std::fprintf(out, "  %-10s %-18s %s: %s\n", status_of(c).c_str(), c.engine.c_str(),
                 c.workload.name.c_str(), c.error.c_str());
  }
  if (!r.references.empty()) {
    std::fprintf(out, "\nreferences:\n");
    for (const auto& ref : r.references) {
      if (ref.ok) {
        std::fprintf(out, "  %-34s %8.2f GB/s   (%s)\n", ref.name.c_str(), ref.gbps,
                     ref.detail.c_str());
      } else {
        std::fprintf(out, "  %-34s  skipped: %s\n", ref.name.c_str(), ref.detail.c_str());
      }
    }
  }
  for (const auto& n : r.notes) std::fprintf(out, "note: %s\n", n.c_str());
}

// ---- JSON ----------------------------------------------------------------------

void write_json(std::FILE* out, const Report& r) {
  std::fprintf(out, "{\n  \"tool\": %s,\n  \"date\": %s,\n  \"nproc\": %u,\n",
               json_str(r.tool).c_str(), json_str(r.date).c_str(), r.nproc);
  std::fprintf(out, "  \"suite\": %s,\n  \"threads\": %u,\n  \"repeat\": %u,\n",
               json_str(r.suite).c_str(), r.threads, r.repeat);
  std::fprintf(out, "  \"min_time_s\": %s,\n  \"engines_built\": [", num(r.min_time_s).c_str());
  for (std::size_t i = 0; i < r.engines_built.size(); ++i) {
    std::fprintf(out, "%s%s", i ? ", " : "", json_str(r.engines_built[i]).c_str());
  }
  std::fprintf(out, "],\n  \"cases\": [");
  bool first = true;
  for (const auto& c : r.cases) {
    const Workload& w = c.workload;
    std::fprintf(out, "%s\n    {\"engine\": %s, \"case\": %s, \"status\": %s", first ? "" : ",",
                 json_str(c.engine).c_str(), json_str(w.name).c_str(),
                 json_str(status_of(c)).c_str());
    first = false;
    std::fprintf(
        out,
        ", \"workload\": {\"group\": %s, \"model\": %s, \"tokens\": %llu, \"start_len\": %llu"
        ", \"page_size\": %u, \"page_table\": %s, \"layout\": %s, \"remote_layout\": %s"
        ", \"piece_bytes\": %llu, \"batch\": %u, \"bytes_per_request\": %llu}",
        json_str(w.group).c_str(), json_str(w.model).c_str(),
        static_cast<unsigned long long>(w.tokens), static_cast<unsigned long long>(w.start_len),
        w.local.page_size, json_str(to_string(w.table)).c_str(),
        json_str(w.local.to_string()).c_str(), json_str(w.remote.to_string()).c_str(),
        static_cast<unsigned long long>(w.piece_bytes), w.batch,
        static_cast<unsigned long long>(w.bytes_per_request()));
    if (!c.ok) std::fprintf(out, ", \"error\": %s", json_str(c.error).c_str());
    if (c.ok) {
      std::fprintf(
          out,
          ", \"gbps\": {\"median\": %s, \"min\": %s, \"max\": %s}, \"requests_per_s\": %s"
          ", \"latency_us\": {\"p50\": %s, \"p99\": %s}, \"requests\": %llu"
          ", \"reads\": %llu, \"copies\": %llu, \"copies_uncoalesced\": %llu"
          ", \"median_copy_bytes\": %llu, \"verified\": %s",
          num(c.gbps.median).c_str(), num(c.gbps.min).c_str(), num(c.gbps.max).c_str(),
          num(c.requests_per_s).c_str(), num(c.p50_us).c_str(), num(c.p99_us).c_str(),
          static_cast<unsigned long long>(c.requests), static_cast<unsigned long long>(c.reads),
          static_cast<unsigned long long>(c.copies), static_cast<unsigned long long>(c.uncoalesced),
          static_cast<unsigned long long>(c.piece_bytes), c.verified ? "true" : "false");
      if (c.prep_us) {
        std::fprintf(out, ", \"phases_us\": {\"prep\": %s, \"post\": %s, \"transfer\": %s}",
                     num(*c.prep_us).c_str(), num(*c.post_us).c_str(), num(*c.transfer_us).c_str());
      }
    }
    std::fprintf(out, ", \"wall_s\": %s, \"baseline\": ", num(c.wall_s).c_str());
    if (c.baseline_gbps) {
      std::fprintf(out, "{\"name\": %s, \"gbps\": {\"median\": %s, \"min\": %s, \"max\": %s}}",
                   json_str(c.baseline_name).c_str(), num(c.baseline_gbps->median).c_str(),
                   num(c.baseline_gbps->min).c_str(), num(c.baseline_gbps->max).c_str());
    } else {
      std::fprintf(out, "null");
    }
    std::fprintf(out, ", \"ratio_to_baseline\": %s", c.ratio ? num(*c.ratio).c_str() : "null");
    std::fprintf(out, ", \"references_gbps\": {");
    bool f2 = true;
    for (const auto& [k, v] : c.extra) {
      std::fprintf(out, "%s%s: %s", f2 ? "" : ", ", json_str(k).c_str(), num(v).c_str());
      f2 = false;
    }
    std::fprintf(out, "}}");
  }
  std::fprintf(out, "\n  ],\n  \"references\": [");
  first = true;
  for (const auto& ref : r.references) {
    std::fprintf(out, "%s\n    {\"name\": %s, \"ok\": %s, \"gbps\": %s, \"detail\": %s}",
                 first ? "" : ",", json_str(ref.name).c_str(), ref.ok ? "true" : "false",
                 ref.ok ? num(ref.gbps).c_str() : "null", json_str(ref.detail).c_str());
    first = false;
  }
  std::fprintf(out, "\n  ],\n  \"notes\": [");
  for (std::size_t i = 0; i < r.notes.size(); ++i) {
    std::fprintf(out, "%s%s", i ? ", " : "", json_str(r.notes[i]).c_str());
  }
  std::fprintf(out, "]\n}\n");
}

// ---- CSV -----------------------------------------------------------------------

void write_csv(std::FILE* out, const Report& r) {
  std::fprintf(out,
               "engine,case,status,group,model,tokens,start_len,page_size,page_table,piece_bytes,"
               "batch,bytes_per_request,reads,copies,copies_uncoalesced,gbps_median,gbps_min,"
               "gbps_max,requests_per_s,p50_us,p99_us,baseline,baseline_gbps,ratio_to_baseline,"
               "verified\n");
  for (const auto& c : r.cases) {
    const Workload& w = c.workload;
    std::fprintf(out, "%s,%s,%s,%s,%s,%llu,%llu,%u,%s,%llu,%u,%llu,", c.engine.c_str(),
                 w.name.c_str(), status_of(c).c_str(), w.group.c_str(), w.model.c_str(),
                 static_cast<unsigned long long>(w.tokens),
                 static_cast<unsigned long long>(w.start_len), w.local.page_size,
                 to_string(w.table), static_cast<unsigned long long>(w.piece_bytes), w.batch,
                 static_cast<unsigned long long>(w.bytes_per_request()));
    if (c.ok) {
      std::fprintf(
          out, "%llu,%llu,%llu,%s,%s,%s,%s,%s,%s,", static_cast<unsigned long long>(c.reads),
          static_cast<unsigned long long>(c.copies), static_cast<unsigned long long>(c.uncoalesced),
          num(c.gbps.median).c_str(), num(c.gbps.min).c_str(), num(c.gbps.max).c_str(),
          num(c.requests_per_s).c_str(), num(c.p50_us).c_str(), num(c.p99_us).c_str());
    } else {
      std::fprintf(out, ",,,,,,,,,");
    }
    std::fprintf(out, "%s,%s,%s,%s\n", c.baseline_name.c_str(),
                 c.baseline_gbps ? num(c.baseline_gbps->median).c_str() : "",
                 c.ratio ? num(*c.ratio).c_str() : "", c.verified ? "true" : "false");
  }
}

// ---- SVG -----------------------------------------------------------------------

void write_svg(std::FILE* out, const Report& r) {
  struct Point {
    double x, y;
  };
  std::map<std::string, std::vector<Point>> lines;      // engine -> (piece, GB/s)
  std::map<std::string, std::vector<Point>> baselines;  // engine -> (piece, baseline GB/s)
  std::map<std::string, std::string> baseline_names;
  std::vector<std::string> order;
  double xmin = 1e300, xmax = 0, ymax = 0;
  for (const auto& c : r.cases) {
    if (!c.ok || c.workload.group != "piece") continue;
    const double x = static_cast<double>(c.workload.piece_bytes);
    if (!lines.count(c.engine)) order.push_back(c.engine);
    lines[c.engine].push_back({x, c.gbps.median});
    xmin = std::min(xmin, x);
    xmax = std::max(xmax, x);
    ymax = std::max(ymax, c.gbps.max);
    if (c.baseline_gbps) {
      baselines[c.engine].push_back({x, c.baseline_gbps->median});
      // One legend entry per engine: drop the per-case message size.
      const std::string& n = c.baseline_name;
      baseline_names[c.engine] = n.rfind("ucx_perftest", 0) == 0
                                     ? n.substr(0, n.rfind(' ', n.rfind(' ') - 1)) + ", same size"
                                     : n;
      ymax = std::max(ymax, c.baseline_gbps->median);
    }
  }
  const double W = 1120, H = 560, L = 70, R = 420, T = 50, B = 60;
  std::fprintf(out,
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
               "viewBox=\"0 0 %g %g\" font-family=\"sans-serif\" font-size=\"12\">\n",
               W, H, W, H);
  std::fprintf(out, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
  std::fprintf(out,
               "<text x=\"%g\" y=\"24\" font-size=\"15\">%s: bandwidth vs piece size "
               "(%s, %u cores, %u threads)</text>\n",
               L, xml(r.tool).c_str(), xml(r.date).c_str(), r.nproc, r.threads);
  if (lines.empty()) {
    std::fprintf(out, "<text x=\"%g\" y=\"%g\">no piece-size sweep cases were measured</text>\n", L,
                 H / 2);
    std::fprintf(out, "</svg>\n");
    return;
  }
  if (xmax <= xmin) xmax = xmin * 2;
  // A round y range.
  const double raw_step = ymax / 5;
  const double mag = std::pow(10, std::floor(std::log10(std::max(raw_step, 1e-9))));
  double step = mag;
  for (const double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * mag >= raw_step) {
      step = m * mag;
      break;
    }
  }
  const double ytop = std::ceil(ymax * 1.05 / step) * step;
  const double pw = W - L - R, ph = H - T - B;
  auto X = [&](double x) {
    return L + pw * (std::log2(x) - std::log2(xmin)) / (std::log2(xmax) - std::log2(xmin));
  };
  auto Y = [&](double y) { return T + ph * (1 - y / ytop); };
  // Axes and grid.
  for (double y = 0; y <= ytop + 1e-9; y += step) {
    std::fprintf(out,
                 "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                 "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                 L, Y(y), L + pw, Y(y), L - 6, Y(y) + 4, y);
  }
  std::set<double> xs;
  for (const auto& [e, pts] : lines) {
    for (const auto& p : pts) xs.insert(p.x);
  }
  for (const double x : xs) {
    std::fprintf(out,
                 "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>"
                 "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                 X(x), T, X(x), T + ph, X(x), T + ph + 18, size_label(x).c_str());
  }
  std::fprintf(
      out, "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" stroke=\"#333\"/>\n",
      L, T, pw, ph);
  std::fprintf(out,
               "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">piece size (bytes per read, "
               "log scale)</text>\n",
               L + pw / 2, H - 16);
  std::fprintf(out,
               "<text x=\"18\" y=\"%g\" text-anchor=\"middle\" transform=\"rotate(-90 18 %g)\">"
               "GB/s (1e9 B/s, median)</text>\n",
               T + ph / 2, T + ph / 2);
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                  "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};
  double ly = T + 10;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const std::string& e = order[i];
    const char* col = kColors[i % 8];
    auto poly = [&](std::vector<Point> pts, const char* dash) {
      std::sort(pts.begin(), pts.end(), [](const Point& a, const Point& b) { return a.x < b.x; });
      std::fprintf(out, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"", col,
                   dash);
      for (const auto& p : pts) std::fprintf(out, "%.1f,%.1f ", X(p.x), Y(p.y));
      std::fprintf(out, "\"/>\n");
      return pts;
    };
    for (const auto& p : poly(lines[e], "")) {
      std::fprintf(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n", X(p.x), Y(p.y),
                   col);
    }
    std::fprintf(
        out,
        "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>"
        "<text x=\"%g\" y=\"%.1f\">%s</text>\n",
        W - R + 15, ly, W - R + 45, ly, col, W - R + 52, ly + 4, xml(e).c_str());
    ly += 18;
    if (baselines.count(e)) {
      poly(baselines[e], " stroke-dasharray=\"6 4\"");
      std::fprintf(
          out,
          "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\" "
          "stroke-dasharray=\"6 4\"/><text x=\"%g\" y=\"%.1f\">%s baseline (%s)</text>\n",
          W - R + 15, ly, W - R + 45, ly, col, W - R + 52, ly + 4, xml(e).c_str(),
          xml(baseline_names[e]).c_str());
      ly += 18;
    }
  }
  // Peers measured at one size (e.g. Mooncake's transfer_engine_bench) are
  // among the cases already; references without a size go in the legend.
  for (const auto& ref : r.references) {
    if (!ref.ok) continue;
    std::fprintf(out, "<text x=\"%g\" y=\"%.1f\" fill=\"#555\">%s: %.2f GB/s</text>\n", W - R + 15,
                 ly + 4, xml(ref.name).c_str(), ref.gbps);
    ly += 18;
  }
  std::fprintf(out, "</svg>\n");
}

}  // namespace mstar::kv::cli::bench
