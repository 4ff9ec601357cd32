#include "args.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "flashkv/core/error.h"

namespace flashkv::app {

Args::Args(int argc, char** argv, int first, std::string command, std::string summary,
           std::vector<FlagSpec> flags)
    : command_(std::move(command)), summary_(std::move(summary)), flags_(std::move(flags)) {
  for (const FlagSpec& f : flags_) values_[f.name] = f.value.empty() ? "0" : f.fallback;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage().c_str(), stdout);
      std::exit(0);
    }
    const FlagSpec* spec = nullptr;
    std::string name = a, inline_value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      name = a.substr(0, eq);
      inline_value = a.substr(eq + 1);
    }
    for (const FlagSpec& f : flags_)
      if (f.name == name) spec = &f;
    if (!spec) fail("unknown option '" + a + "' (see --help)");
    if (spec->value.empty()) {
      if (eq != std::string::npos) fail("option " + name + " takes no value");
      values_[name] = "1";
    } else if (eq != std::string::npos) {
      values_[name] = inline_value;
    } else {
      if (i + 1 >= argc) fail("option " + name + " needs a value (" + spec->value + ")");
      values_[name] = argv[++i];
    }
    given_[name] = true;
  }
}

const std::string& Args::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) fail("internal: undeclared option " + name);
  return it->second;
}

int Args::get_int(const std::string& name) const {
  const std::string& v = get(name);
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < -(1L << 30) || x > (1L << 30))
    fail("option " + name + " expects an integer, got '" + v + "'");
  return static_cast<int>(x);
}

int Args::get_int(const std::string& name, int lo, int hi, int auto_value) const {
  if (get(name) == "auto") return auto_value;
  const int x = get_int(name);
  if (x < lo || x > hi) fail(str_cat("option ", name, " expects ", lo, "..", hi, ", got ", x));
  return x;
}

double Args::get_double(const std::string& name, double lo, double hi) const {
  const std::string& v = get(name);
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(x >= lo && x <= hi))
    fail(str_cat("option ", name, " expects a number in ", lo, "..", hi, ", got '", v, "'"));
  return x;
}

DType Args::get_dtype(const std::string& name, std::initializer_list<DType> allowed,
                      DType auto_value) const {
  const std::string& v = get(name);
  if (v == "auto") return auto_value;
  std::string names;
  for (DType t : allowed) {
    if (v == dtype_name(t)) return t;
    names += std::string(names.empty() ? "" : ", ") + dtype_name(t);
  }
  fail("option " + name + " expects one of " + names + ", got '" + v + "'");
}

Device Args::device() const {
  const std::string& s = get("--device");
  if (s == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();
  Device d;
  try {
    d = parse_device(s);
  } catch (const Error&) {
    fail("--device expects auto, cpu, cuda or cuda:N, got '" + s + "'");
  }
  if (d.is_cuda() && !built_with_cuda())
    fail("--device " + s + ": this flashkv was built without CUDA");
  if (d.is_cuda() && d.index >= cuda_device_count())
    fail(cuda_device_count() == 0
             ? "--device " + s + ": no GPU is visible"
             : str_cat("--device ", s, ": only ", cuda_device_count(), " GPUs are visible"));
  return d;
}

void Args::require_writable(const std::string& name) const {
  const std::string& path = get(name);
  if (path.empty()) return;
  std::ofstream out(path, std::ios::binary | std::ios::app);
  if (!out.good()) fail(name + " " + path + ": cannot open for writing");
}

void Args::fail(const std::string& message) const {
  std::fprintf(stderr, "flashkv %s: %s\n", command_.c_str(), message.c_str());
  std::exit(2);
}

std::string Args::usage() const {
  std::ostringstream os;
  os << "usage: flashkv " << command_ << " [options]\n\n" << summary_ << "\n\noptions:\n";
  for (const FlagSpec& f : flags_) {
    std::string left = "  " + f.name + (f.value.empty() ? "" : " " + f.value);
    if (left.size() < 30)
      left.resize(30, ' ');
    else
      left += "\n" + std::string(30, ' ');
    os << left << f.help;
    if (!f.value.empty() && !f.fallback.empty()) os << " (default: " << f.fallback << ")";
    os << "\n";
  }
  os << "  --help                      this text\n";
  return os.str();
}

}  // namespace flashkv::app
