// The subcommands of the `flashkv` binary.
#pragma once

namespace flashkv::app {

// Each takes the full argv; its own flags start at argv[2]. Returns the exit code.
int cmd_info(int argc, char** argv);
int cmd_check(int argc, char** argv);
int cmd_serve(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_soak(int argc, char** argv);

}  // namespace flashkv::app
