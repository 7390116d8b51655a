// Checking a plugin file before it is mapped (see plugin_file.hpp).
#include "plugin_file.hpp"

#include <elf.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "rlhost/sdk/input_file.hpp"

namespace rlh::host {
namespace {

#if defined(__x86_64__)
constexpr uint16_t kMachine = EM_X86_64;
constexpr const char* kMachineName = "x86-64";
#elif defined(__aarch64__)
constexpr uint16_t kMachine = EM_AARCH64;
constexpr const char* kMachineName = "aarch64";
#else
#error "plugin_file.cpp: add this machine's ELF e_machine"
#endif

constexpr uint32_t kMaxPhdrs = 4096;
constexpr uint64_t kMaxDynamicBytes = 1u << 20;

// a + b <= limit without overflow.
bool fits(uint64_t a, uint64_t b, uint64_t limit) { return a <= limit && b <= limit - a; }

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

struct Loaded {
  uint64_t vaddr, filesz, memsz;
};

}  // namespace

std::string check_elf_image(uint64_t size, const ReadAt& read) {
  Elf64_Ehdr eh;
  if (size < sizeof(eh) || !read(0, sizeof(eh), &eh))
    return "is not a shared library (" + std::to_string(size) + " bytes, shorter than an ELF header)";
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0) return "is not a shared library (no ELF magic)";
  if (eh.e_ident[EI_CLASS] != ELFCLASS64) return "is not a 64-bit ELF file";
  if (eh.e_ident[EI_DATA] != ELFDATA2LSB) return "is not a little-endian ELF file";
  if (eh.e_ident[EI_VERSION] != EV_CURRENT || eh.e_version != EV_CURRENT) return "has an unknown ELF version";
  if (eh.e_type != ET_DYN) return "is not a shared library (ELF type " + std::to_string(eh.e_type) + ")";
  if (eh.e_machine != kMachine)
    return "is built for another machine (ELF machine " + std::to_string(eh.e_machine) + ", this host is " +
           kMachineName + ")";
  if (eh.e_ehsize < sizeof(Elf64_Ehdr)) return "has a malformed ELF header (e_ehsize)";
  if (eh.e_phentsize != sizeof(Elf64_Phdr)) return "has a malformed ELF header (e_phentsize)";
  if (eh.e_phnum == 0 || eh.e_phnum > kMaxPhdrs)
    return "has " + std::to_string(eh.e_phnum) + " program headers (1 to " + std::to_string(kMaxPhdrs) + " expected)";
  const uint64_t ph_bytes = uint64_t{eh.e_phnum} * sizeof(Elf64_Phdr);
  if (!fits(eh.e_phoff, ph_bytes, size))
    return "is truncated: its program headers end at byte " + std::to_string(eh.e_phoff + ph_bytes) +
           " of a " + std::to_string(size) + "-byte file";
  std::vector<Elf64_Phdr> ph(eh.e_phnum);
  if (!read(eh.e_phoff, ph_bytes, ph.data())) return "cannot be read (program headers)";
  // The section headers sit at the end of the file: a truncated copy loses them first.
  if (eh.e_shoff != 0) {
    if (eh.e_shentsize != sizeof(Elf64_Shdr)) return "has a malformed ELF header (e_shentsize)";
    const uint64_t sh_bytes = uint64_t{eh.e_shnum} * sizeof(Elf64_Shdr);
    if (!fits(eh.e_shoff, sh_bytes, size))
      return "is truncated: its section headers end at byte " + std::to_string(eh.e_shoff + sh_bytes) + " of a " +
             std::to_string(size) + "-byte file";
  }

  std::vector<Loaded> loads;
  const Elf64_Phdr* dyn = nullptr;
  for (size_t i = 0; i < ph.size(); ++i) {
    const Elf64_Phdr& p = ph[i];
    if (p.p_type == PT_NULL) continue;
    const std::string which = "segment #" + std::to_string(i);
    if (p.p_type != PT_GNU_STACK && !fits(p.p_offset, p.p_filesz, size))
      return "is truncated: " + which + " (" + hex(p.p_offset) + " + " + hex(p.p_filesz) + " bytes) ends past the " +
             std::to_string(size) + "-byte file";
    if (p.p_type == PT_LOAD) {
      if (p.p_filesz > p.p_memsz) return "has a malformed " + which + " (file size above memory size)";
      if (p.p_align > 1 && ((p.p_align & (p.p_align - 1)) != 0 || (p.p_vaddr - p.p_offset) % p.p_align != 0))
        return "has a malformed " + which + " (alignment)";
      if (!fits(p.p_vaddr, p.p_memsz, UINT64_MAX)) return "has a malformed " + which + " (address range)";
      loads.push_back({p.p_vaddr, p.p_filesz, p.p_memsz});
    } else if (p.p_type == PT_DYNAMIC) {
      if (dyn != nullptr) return "has two dynamic sections";
      dyn = &p;
    }
  }
  if (loads.empty()) return "has no loadable segment";
  if (dyn == nullptr) return "has no dynamic section (not a shared library)";
  if (dyn->p_filesz % sizeof(Elf64_Dyn) != 0 || dyn->p_filesz == 0 || dyn->p_filesz > kMaxDynamicBytes)
    return "has a malformed dynamic section (" + std::to_string(dyn->p_filesz) + " bytes)";

  // File offset of `len` bytes at address `addr`, when a loaded segment holds them from the file.
  auto in_file = [&](uint64_t addr, uint64_t len) {
    for (const Loaded& l : loads)
      if (addr >= l.vaddr && fits(addr - l.vaddr, len, l.filesz)) return true;
    return false;
  };
  if (!in_file(dyn->p_vaddr, dyn->p_filesz)) return "has a dynamic section outside its loaded segments";

  std::vector<Elf64_Dyn> d(dyn->p_filesz / sizeof(Elf64_Dyn));
  if (!read(dyn->p_offset, dyn->p_filesz, d.data())) return "cannot be read (dynamic section)";
  uint64_t strtab = 0, strsz = 0, symtab = 0, rela = 0, relasz = 0, jmprel = 0, pltrelsz = 0;
  bool has_strtab = false, has_symtab = false, terminated = false;
  std::vector<std::pair<const char*, uint64_t>> tables;  // addresses that must be file-backed
  for (const Elf64_Dyn& e : d) {
    if (e.d_tag == DT_NULL) {
      terminated = true;
      break;
    }
    const uint64_t v = e.d_un.d_val;
    switch (e.d_tag) {
      case DT_STRTAB: strtab = v, has_strtab = true; break;
      case DT_STRSZ: strsz = v; break;
      case DT_SYMTAB: symtab = v, has_symtab = true; break;
      case DT_RELA: rela = v; break;
      case DT_RELASZ: relasz = v; break;
      case DT_JMPREL: jmprel = v; break;
      case DT_PLTRELSZ: pltrelsz = v; break;
      case DT_HASH: tables.emplace_back("hash table", v); break;
      case DT_GNU_HASH: tables.emplace_back("GNU hash table", v); break;
      case DT_VERSYM: tables.emplace_back("symbol versions", v); break;
      case DT_VERDEF: tables.emplace_back("version definitions", v); break;
      case DT_VERNEED: tables.emplace_back("version needs", v); break;
      default: break;
    }
  }
  if (!terminated) return "has a dynamic section without its terminating entry";
  if (!has_strtab || !has_symtab) return "has no dynamic symbol or string table";
  if (!in_file(strtab, strsz)) return "is truncated or damaged: its string table lies outside the file's segments";
  if (!in_file(symtab, sizeof(Elf64_Sym))) return "is truncated or damaged: its symbol table lies outside the file's segments";
  if (relasz > 0 && !in_file(rela, relasz)) return "is truncated or damaged: its relocations lie outside the file's segments";
  if (pltrelsz > 0 && !in_file(jmprel, pltrelsz))
    return "is truncated or damaged: its PLT relocations lie outside the file's segments";
  for (const auto& [what, addr] : tables)
    if (!in_file(addr, 4)) return std::string("is truncated or damaged: its ") + what + " lies outside the file's segments";
  return {};
}

std::string check_plugin_file(const std::string& path) {
  uint64_t size = 0;
  sdk::InputFd fd;
  try {
    fd = sdk::open_input_file(path, 0, "plugin", &size);
  } catch (const sdk::InputError& e) {
    // "plugin '<path>' is a FIFO, ..." -> the part after the name (the caller names the file).
    const std::string m = e.what();
    const std::string prefix = "plugin '" + path + "' ";
    return m.rfind(prefix, 0) == 0 ? m.substr(prefix.size()) : m;
  }
  const int f = fd.get();
  return check_elf_image(size, [f, size](uint64_t offset, size_t len, void* out) {
    if (offset > size || len > size - offset) return false;
    auto* p = static_cast<char*>(out);
    while (len > 0) {
      const ssize_t r = ::pread(f, p, len, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      p += r;
      offset += static_cast<uint64_t>(r);
      len -= static_cast<size_t>(r);
    }
    return true;
  });
}

}  // namespace rlh::host
