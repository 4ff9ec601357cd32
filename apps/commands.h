// The subcommands of the `flashkv` binary.
#pragma once

#include <string>

namespace flashkv::app {

// Each takes the full argv; its own flags start at argv[2]. Returns the exit code.
int cmd_info(int argc, char** argv);
int cmd_check(int argc, char** argv);
int cmd_serve(int argc, char** argv);
int cmd_bench(int argc, char** argv);

class Args;
// Exits 2 unless the file named by option `flag` (when given) can be opened for writing.
void require_writable(const Args& args, const std::string& flag);

}  // namespace flashkv::app
