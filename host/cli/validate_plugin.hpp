// `loom validate-plugin PLUGIN`: runs a plugin through its life in a child process (load and
// describe; per kind: schema, create with defaults, a generic step, a state round trip,
// destroy) and reports each stage as ok, failed or skipped. A crash, hang or exit inside the
// plugin is reported with the stage it happened in.
#pragma once

#include <string>

namespace loom_validate {

// The command: `plugin` is a file (a path containing '/' or ending in .so) or a name looked up
// on the search path (`plugin_path` first). 0 when every stage was ok or skipped, 1 otherwise.
int validate_plugin_main(const std::string& plugin, const std::string& plugin_path);

// `loom __validate-plugin FILE`, the child: runs the stages, printing to stdout, before each,
// a marker line "@ STAGE", then its result "STAGE: ok|failed|skipped[: NOTE]", and "@end" last.
int validate_plugin_child(const std::string& file);

}  // namespace loom_validate
