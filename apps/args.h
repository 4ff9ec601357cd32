// A small command-line flag parser: `--name value` and `--flag`, with --help text generated
// from the declared flags. Bad flags print one clear line and exit with code 2.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace flashkv::app {

struct FlagSpec {
  std::string name;       // "--device"
  std::string value;      // "auto|cpu|cuda"; empty for a boolean flag
  std::string help;
  std::string fallback;   // default value
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
  [[noreturn]] void fail(const std::string& message) const;  // "flashkv <cmd>: message", exit 2
  std::string usage() const;

 private:
  std::string command_, summary_;
  std::vector<FlagSpec> flags_;
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> given_;
};

}  // namespace flashkv::app
