# loom_add_plugin(NAME <name> SOURCES <src>... [LINK_LIBRARIES <lib>...] [NO_INSTALL])
#
# Builds the Loom plugin <name> as the module library loom_<name>.so (target loom_<name>):
# C++20, hidden visibility, no undefined symbols, and a version script that exports only
# the loom_plugin_entry_v* symbols, so two plugins can never resolve each other's code.
#
# Honoured variables:
#   LOOM_PLUGIN_OUTPUT_DIR   where the .so is written in the build tree (default: CMake's,
#                            i.e. the current binary dir)
#   LOOM_PLUGIN_INSTALL_DIR  where it is installed (default: <libdir>/loom/plugins, where
#                            the host looks last)
# NO_INSTALL leaves it out of `cmake --install` (a plugin only tests load).
include_guard(GLOBAL)
include(GNUInstallDirs)

function(loom_add_plugin)
  cmake_parse_arguments(PARSE_ARGV 0 ARG "NO_INSTALL" "NAME" "SOURCES;LINK_LIBRARIES")
  if(ARG_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "loom_add_plugin: unknown arguments: ${ARG_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT ARG_NAME)
    message(FATAL_ERROR "loom_add_plugin: NAME is required")
  endif()
  # The same rule the host applies to the manifest's `plugin = "..."`.
  if(NOT ARG_NAME MATCHES "^[a-z0-9_]+$")
    message(FATAL_ERROR "loom_add_plugin: NAME '${ARG_NAME}' must match [a-z0-9_]+")
  endif()
  if(NOT ARG_SOURCES)
    message(FATAL_ERROR "loom_add_plugin(${ARG_NAME}): SOURCES is required")
  endif()

  set(target loom_${ARG_NAME})
  add_library(${target} MODULE ${ARG_SOURCES})
  target_link_libraries(${target} PRIVATE Loom::sdk ${ARG_LINK_LIBRARIES})
  target_compile_features(${target} PRIVATE cxx_std_20)
  set_target_properties(${target} PROPERTIES
    PREFIX ""
    OUTPUT_NAME loom_${ARG_NAME}
    CXX_EXTENSIONS OFF
    POSITION_INDEPENDENT_CODE ON
    C_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)

  if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
    set(map ${CMAKE_CURRENT_BINARY_DIR}/${target}.exports.map)
    # Written only when it changes, so reconfiguring does not relink.
    file(CONFIGURE OUTPUT ${map} CONTENT "{\n  global: loom_plugin_entry_v*;\n  local: *;\n};\n")
    target_link_options(${target} PRIVATE "LINKER:--version-script=${map}")
    set_property(TARGET ${target} APPEND PROPERTY LINK_DEPENDS ${map})
    # Clang does not link the sanitizer runtimes into shared objects, so their symbols are
    # legitimately undefined there; everywhere else a missing symbol fails the link now
    # instead of the host's dlopen later.
    set(sanitized FALSE)
    if(CMAKE_CXX_COMPILER_ID MATCHES "Clang" AND
       (LOOM_SANITIZE OR CMAKE_CXX_FLAGS MATCHES "-fsanitize"))
      set(sanitized TRUE)
    endif()
    if(NOT sanitized)
      target_link_options(${target} PRIVATE "LINKER:--no-undefined")
    endif()
  endif()

  if(DEFINED LOOM_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${LOOM_PLUGIN_OUTPUT_DIR})
  endif()

  if(DEFINED LOOM_PLUGIN_INSTALL_DIR)
    set(destination ${LOOM_PLUGIN_INSTALL_DIR})
  else()
    set(destination ${CMAKE_INSTALL_LIBDIR}/loom/plugins)
  endif()
  # Default permissions (0755 files, 0755 dirs): the host refuses group- or
  # other-writable plugins.
  if(NOT ARG_NO_INSTALL)
    install(TARGETS ${target} LIBRARY DESTINATION ${destination})
  endif()
endfunction()
