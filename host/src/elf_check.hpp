// A look at a file before dlopen: a truncated or foreign file must give an error, not
// a SIGBUS inside the dynamic loader.
#pragma once

#include <filesystem>
#include <string>

namespace loom::host {

// "" when `path` looks like a complete 64-bit ELF shared object for this machine,
// otherwise why not.
std::string check_elf_file(const std::filesystem::path& path);

// "" when neither the file nor its folder can be written by anyone but its owner,
// otherwise why it must not be loaded.
std::string check_plugin_permissions(const std::filesystem::path& path);

}  // namespace loom::host
