#include "elf_check.hpp"

#include <elf.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

namespace loom::host {

std::string check_elf_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "cannot open the file: " + std::string(std::strerror(errno));
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  Elf64_Ehdr eh{};
  if (size < sizeof(eh)) {
    return "not a shared library: the file is " + std::to_string(size) +
           " bytes, shorter than an ELF header";
  }
  in.read(reinterpret_cast<char*>(&eh), sizeof(eh));  // NOLINT
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0) {
    return "not a shared library: the file does not start with the ELF magic bytes";
  }
  if (eh.e_ident[EI_CLASS] != ELFCLASS64) return "not a 64-bit ELF file";
  if (eh.e_type != ET_DYN) return "not a shared library (ELF type is not ET_DYN)";
#if defined(__x86_64__)
  if (eh.e_machine != EM_X86_64)
    return "built for another processor (ELF machine " + std::to_string(eh.e_machine) + ")";
#elif defined(__aarch64__)
  if (eh.e_machine != EM_AARCH64)
    return "built for another processor (ELF machine " + std::to_string(eh.e_machine) + ")";
#endif
  auto truncated = [&](uint64_t need) {
    std::ostringstream os;
    os << "truncated: the file is " << size << " bytes but its ELF headers describe at least "
       << need << " bytes";
    return os.str();
  };
  const uint64_t ph_end = eh.e_phoff + uint64_t{eh.e_phnum} * eh.e_phentsize;
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || ph_end > size) return truncated(ph_end);
  const uint64_t sh_end = eh.e_shoff + uint64_t{eh.e_shnum} * eh.e_shentsize;
  if (eh.e_shoff != 0 && sh_end > size) return truncated(sh_end);
  std::vector<Elf64_Phdr> phdrs(eh.e_phnum);
  in.seekg(static_cast<std::streamoff>(eh.e_phoff));
  in.read(reinterpret_cast<char*>(phdrs.data()),  // NOLINT
          static_cast<std::streamsize>(phdrs.size() * sizeof(Elf64_Phdr)));
  if (!in) return truncated(ph_end);
  for (const auto& ph : phdrs) {
    const uint64_t end = ph.p_offset + ph.p_filesz;
    if (ph.p_type == PT_LOAD && end > size) return truncated(end);
  }
  return {};
}

std::string check_plugin_permissions(const std::filesystem::path& path) {
  auto writable_by_others = [](const std::filesystem::path& p, std::string* why) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) {
      *why = "cannot stat " + p.string() + ": " + std::strerror(errno);
      return true;
    }
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
      std::ostringstream os;
      os << p.string() << " can be written by users other than its owner (mode " << std::oct
         << (st.st_mode & 07777)
         << "); loading a plugin runs its code, so Loom refuses it (fix: chmod go-w " << p.string()
         << ")";
      *why = os.str();
      return true;
    }
    return false;
  };
  std::string why;
  std::error_code ec;
  const auto real = std::filesystem::canonical(path, ec);
  if (ec) return "cannot resolve " + path.string() + ": " + ec.message();
  if (writable_by_others(real, &why)) return why;
  if (writable_by_others(real.parent_path(), &why)) return why;
  return {};
}

}  // namespace loom::host
