// Checking a plugin file before it is mapped.
//
// dlopen maps a shared library's segments straight from the file; a segment that reaches past
// the end of a truncated file is mapped all the same, and the first touch of it is a SIGBUS that
// kills the host -- even when it only lists plugins. A FIFO or /dev/zero given as a plugin would
// block or be read forever. So a plugin file is checked first, reading only its headers: a regular
// file; an ELF shared object of this machine's class, byte order and architecture; every program
// header, every loaded segment, the dynamic section, the tables the dynamic loader reads through
// it (symbols, strings, hashes, relocations, versions) and the section header table inside the
// file. A file that fails is refused with one line naming the problem, and the host carries on.
//
// (Checks cannot make a hostile library safe -- its code runs in the host once loaded -- but a
// damaged or truncated file cannot take the host down.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace rlh::host {

// Reads `len` bytes at `offset` into `out`; false when they are not all there.
using ReadAt = std::function<bool(uint64_t offset, size_t len, void* out)>;

// Checks an ELF image of `size` bytes read through `read`. Returns the first problem, empty when
// it can be handed to dlopen.
std::string check_elf_image(uint64_t size, const ReadAt& read);

// Checks the file at `path` (regular file, then check_elf_image over its headers). Returns the
// problem ("is a FIFO, not a regular file", "is truncated: ..."), empty when fine.
std::string check_plugin_file(const std::string& path);

}  // namespace rlh::host
