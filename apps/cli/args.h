// A small command-line flag parser: `--name value` and `--flag`, with --help text generated
// from the declared flags. Bad flags print one clear line and exit with code 2.
#pragma once

#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "flashkv/core/device.h"
#include "flashkv/core/dtype.h"

namespace flashkv::app {

struct FlagSpec {
  std::string name;   // "--device"
  std::string value;  // "auto|cpu|cuda"; empty for a boolean flag
  std::string help;
  std::string fallback;  // default value
};

class Args {
 public:
  // Parses argv[first..argc); on --help prints usage and exits 0; on a bad flag exits 2.
  Args(int argc, char** argv, int first, std::string command, std::string summary,
       std::vector<FlagSpec> flags);
  const std::string& get(const std::string& name) const;
  bool flag(const std::string& name) const { return get(name) == "1"; }
  bool given(const std::string& name) const { return given_.count(name) > 0; }
  int get_int(const std::string& name) const;  // exits 2 when not an integer
  // An integer in [lo, hi]; the value "auto" gives `auto_value`. Exits 2 otherwise.
  int get_int(const std::string& name, int lo, int hi, int auto_value) const;
  double get_double(const std::string& name, double lo, double hi) const;  // exits 2 outside
  // A dtype among `allowed` (names as dtype_name prints them); "auto" gives `auto_value`.
  DType get_dtype(const std::string& name, std::initializer_list<DType> allowed,
                  DType auto_value) const;
  // --device: "auto" is the first GPU when one is visible, else the CPU; asking for CUDA without
  // a GPU (or in a build without CUDA) exits 2 with one line saying which.
  Device device() const;
  // Exits 2 unless the file option `name` names (when given) can be opened for writing: checked
  // before a long run, not after it.
  void require_writable(const std::string& name) const;
  [[noreturn]] void fail(const std::string& message) const;  // "flashkv <cmd>: message", exit 2
  std::string usage() const;

 private:
  std::string command_, summary_;
  std::vector<FlagSpec> flags_;
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> given_;
};

}  // namespace flashkv::app
