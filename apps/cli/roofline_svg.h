// A roofline chart of a benchmark run, as a standalone SVG document: log-log axes of arithmetic
// intensity (FLOP per byte of minimum traffic) against achieved GFLOP/s, the bandwidth ceiling
// (measured read bandwidth times intensity) and the matrix-rate ceiling measured in the same
// run (on a GPU also the rate it sustains back to back, dashed), and one point per case,
// coloured by operator.
#pragma once

#include <string>

#include "attention_bench.h"

namespace flashkv::app {

std::string roofline_svg(const bench::BenchReport& report);

}  // namespace flashkv::app
