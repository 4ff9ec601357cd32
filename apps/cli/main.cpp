// flashkv: serve a workload through the attention backend, soak-test the serving path, benchmark
// the kernels, check every operator against the float64 reference, or describe the build and its
// devices.
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "commands.h"
#include "flashkv/core/error.h"

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int, char**);
};

const Command kCommands[] = {
    {"serve", "run a serving workload through the attention backend and report on it",
     flashkv::app::cmd_serve},
    {"soak", "a long random serving run with the serving invariants checked every step",
     flashkv::app::cmd_soak},
    {"bench", "time the attention kernels against the machine's measured roofline",
     flashkv::app::cmd_bench},
    {"check", "compare every operator with the float64 reference on random inputs",
     flashkv::app::cmd_check},
    {"info", "build features, devices, CPU features, GPU name and SMs", flashkv::app::cmd_info},
};

void usage(FILE* out) {
  std::fprintf(out, "usage: flashkv <command> [options]\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-8s %s\n", c.name, c.summary);
  std::fprintf(out, "\n'flashkv <command> --help' describes a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    try {
      return c.run(argc, argv);
    } catch (const flashkv::Error& e) {
      std::fprintf(stderr, "flashkv %s: %s\n", c.name, e.what());
      return 1;
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "flashkv %s: out of memory\n", c.name);
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "flashkv %s: %s\n", c.name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "flashkv: unknown command '%s' (see flashkv --help)\n", argv[1]);
  return 2;
}
