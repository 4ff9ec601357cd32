#include "roofline_svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace flashkv::app {
namespace {

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double x, const char* f = "%.1f") {
  char buf[32];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

const char* op_colour(bench::BenchOp op) {
  switch (op) {
    case bench::BenchOp::decode:
      return "#1f77b4";
    case bench::BenchOp::prefill:
      return "#d62728";
    case bench::BenchOp::extend:
      return "#2ca02c";
    case bench::BenchOp::verify:
      return "#9467bd";
  }
  return "#000000";
}

// Plot area and the log10 ranges it shows.
struct Frame {
  double left = 90, right = 760, top = 50, bottom = 470;  // pixels
  double lx0, lx1, ly0, ly1;                              // log10 of the axis ends
  double x(double v) const { return left + (std::log10(v) - lx0) / (lx1 - lx0) * (right - left); }
  double y(double v) const { return bottom - (std::log10(v) - ly0) / (ly1 - ly0) * (bottom - top); }
};

}  // namespace

std::string roofline_svg(const bench::BenchReport& report) {
  const bench::Roofline& m = report.machine;
  struct Point {
    double intensity, gflops;
    const bench::CaseResult* r;
  };
  std::vector<Point> points;
  for (const bench::CaseResult& r : report.cases) {
    const double bytes = bench::case_bytes(r.c), flops = bench::case_flops(r.c);
    if (bytes > 0 && flops > 0 && r.tflops > 0)
      points.push_back({flops / bytes, r.tflops * 1e3, &r});
  }
  // Axis ranges: whole decades around the points and the ridge point of the two ceilings.
  const double bw = std::max(m.read_gbps, 1e-3), peak = std::max(m.matmul_gflops, 1e-3);
  const double ridge = peak / bw;
  double xmin = ridge, xmax = ridge, ymin = peak, ymax = peak;
  for (const Point& p : points) {
    xmin = std::min(xmin, p.intensity);
    xmax = std::max(xmax, p.intensity);
    ymin = std::min(ymin, p.gflops);
    ymax = std::max(ymax, p.gflops);
  }
  Frame f;
  f.lx0 = std::floor(std::log10(xmin / 2));
  f.lx1 = std::ceil(std::log10(xmax * 2));
  f.ly0 = std::floor(std::log10(std::min(ymin, bw * std::pow(10.0, f.lx0)) / 2));
  f.ly1 = std::ceil(std::log10(ymax * 2));
  f.ly0 = std::max(f.ly0, f.ly1 - 8);  // a bandwidth line far below the points is clipped

  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"960\" height=\"540\" "
        "viewBox=\"0 0 960 540\" font-family=\"sans-serif\" font-size=\"12\">\n";
  os << "<rect width=\"960\" height=\"540\" fill=\"white\"/>\n";
  os << "<text x=\"" << (f.left + f.right) / 2
     << "\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">"
     << xml_escape("flashkv roofline: " + m.name + " (" + m.device.str() + ")") << "</text>\n";
  // Decade grid and tick labels.
  os << "<g stroke=\"#dddddd\" stroke-width=\"1\">\n";
  for (double e = f.lx0; e <= f.lx1 + 1e-9; ++e)
    os << "<line x1=\"" << num(f.x(std::pow(10.0, e))) << "\" y1=\"" << f.top << "\" x2=\""
       << num(f.x(std::pow(10.0, e))) << "\" y2=\"" << f.bottom << "\"/>\n";
  for (double e = f.ly0; e <= f.ly1 + 1e-9; ++e)
    os << "<line x1=\"" << f.left << "\" y1=\"" << num(f.y(std::pow(10.0, e))) << "\" x2=\""
       << f.right << "\" y2=\"" << num(f.y(std::pow(10.0, e))) << "\"/>\n";
  os << "</g>\n<g fill=\"#333333\">\n";
  for (double e = f.lx0; e <= f.lx1 + 1e-9; ++e)
    os << "<text x=\"" << num(f.x(std::pow(10.0, e))) << "\" y=\"" << f.bottom + 18
       << "\" text-anchor=\"middle\">" << num(std::pow(10.0, e), "%g") << "</text>\n";
  for (double e = f.ly0; e <= f.ly1 + 1e-9; ++e)
    os << "<text x=\"" << f.left - 8 << "\" y=\"" << num(f.y(std::pow(10.0, e)) + 4)
       << "\" text-anchor=\"end\">" << num(std::pow(10.0, e), "%g") << "</text>\n";
  os << "<text x=\"" << (f.left + f.right) / 2 << "\" y=\"" << f.bottom + 42
     << "\" text-anchor=\"middle\">arithmetic intensity (FLOP / byte)</text>\n";
  os << "<text transform=\"translate(24 " << (f.top + f.bottom) / 2
     << ") rotate(-90)\" text-anchor=\"middle\">achieved GFLOP/s</text>\n</g>\n";
  os << "<rect x=\"" << f.left << "\" y=\"" << f.top << "\" width=\"" << f.right - f.left
     << "\" height=\"" << f.bottom - f.top << "\" fill=\"none\" stroke=\"#333333\"/>\n";
  // Ceilings: bandwidth * intensity up to the ridge, then the matrix rate; the bandwidth line
  // starts where it enters the plot.
  const double x_lo = std::max(std::pow(10.0, f.lx0), std::pow(10.0, f.ly0) / bw);
  const double x_hi = std::pow(10.0, f.lx1);
  os << "<polyline fill=\"none\" stroke=\"#555555\" stroke-width=\"2\" points=\"" << num(f.x(x_lo))
     << "," << num(f.y(bw * x_lo)) << " " << num(f.x(ridge)) << "," << num(f.y(peak)) << " "
     << num(f.x(x_hi)) << "," << num(f.y(peak)) << "\"/>\n";
  os << "<text x=\"" << num(f.x(ridge)) << "\" y=\"" << num(f.y(peak) - 8)
     << "\" text-anchor=\"end\" fill=\"#555555\">"
     << xml_escape("matmul " + num(m.matmul_gflops, "%.0f") + " GFLOP/s (" + m.matmul_kind + ")")
     << "</text>\n";
  os << "<text x=\"" << num(f.x(x_lo) + 6) << "\" y=\"" << num(f.y(bw * x_lo) - 8)
     << "\" fill=\"#555555\">" << xml_escape("read " + num(m.read_gbps) + " GB/s") << "</text>\n";
  // On a GPU, the matrix rate the same GEMM sustains back to back (the card's power limit),
  // dashed, from its own ridge: the ceiling of a case timed as long.
  const double sustained = m.matmul_sustained_gflops;
  if (sustained > 0 && sustained < peak) {
    const double s_ridge = std::max(sustained / bw, std::pow(10.0, f.lx0));
    os << "<polyline fill=\"none\" stroke=\"#555555\" stroke-width=\"1.5\" "
          "stroke-dasharray=\"6 4\" points=\""
       << num(f.x(s_ridge)) << "," << num(f.y(sustained)) << " " << num(f.x(x_hi)) << ","
       << num(f.y(sustained)) << "\"/>\n";
    os << "<text x=\"" << num(f.x(x_hi) - 6) << "\" y=\"" << num(f.y(sustained) + 16)
       << "\" text-anchor=\"end\" fill=\"#555555\">"
       << xml_escape("matmul sustained " + num(sustained, "%.0f") + " GFLOP/s") << "</text>\n";
  }
  // One point per case, with its figures as a tooltip.
  for (const Point& p : points) {
    const bench::CaseResult& r = *p.r;
    os << "<circle cx=\"" << num(f.x(p.intensity)) << "\" cy=\"" << num(f.y(p.gflops))
       << "\" r=\"5\" fill=\"" << op_colour(r.c.op) << "\" fill-opacity=\"0.8\"><title>"
       << xml_escape(r.c.str() + ": " + num(r.us) + " us, " + num(r.gbps) + " GB/s, " +
                     num(r.tflops, "%.3f") + " TFLOP/s, " + num(100 * r.roofline_fraction) +
                     "% of roofline" +
                     (r.sustained_fraction > 0
                          ? ", " + num(100 * r.sustained_fraction) + "% of the sustained one"
                          : std::string()))
       << "</title></circle>\n";
  }
  // Legend.
  double ly = f.top + 10;
  for (bench::BenchOp op : {bench::BenchOp::decode, bench::BenchOp::prefill, bench::BenchOp::extend,
                            bench::BenchOp::verify}) {
    os << "<circle cx=\"" << f.right + 24 << "\" cy=\"" << ly << "\" r=\"5\" fill=\""
       << op_colour(op) << "\"/><text x=\"" << f.right + 36 << "\" y=\"" << ly + 4 << "\">"
       << bench::op_name(op) << "</text>\n";
    ly += 20;
  }
  os << "</svg>\n";
  return os.str();
}

}  // namespace flashkv::app
