// rlhost subcommands (tokenize, logprobs, generate, ...): each parses its own options and works
// through librlhost's C API and the components' ABI tables, like any embedder would.
#pragma once

namespace rlh::cli {

bool is_command(const char* name);
// argv[0] is the command name. Returns the process exit code.
int run_command(int argc, char** argv);

// Subcommands defined in their own files (argv[0] is the command name).
int cmd_logprobs(int argc, char** argv);  // cmd_logprobs.cpp
int cmd_generate(int argc, char** argv);  // cmd_generate.cpp
int cmd_check_kernels(int argc, char** argv);  // cmd_check_kernels.cpp

}  // namespace rlh::cli
