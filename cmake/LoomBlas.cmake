# OpenBLAS, resolved by build directory rather than through Debian's alternatives link (which
# points at whichever of the pthread, serial or OpenMP builds apt happened to install):
#
#   loom_blas         the pthread build: the one that may be called from several pool threads at
#                     once. The trainer and the benchmarks link it.
#   loom_blas_serial  the serial build: it starts no threads when it loads, so a plugin (moe)
#                     links it; plugins run on the host's pool and start no threads of their own.
#
# Both builds have the soname libopenblas.so.0, so a process holds one of them: in the trainer
# the plugin uses the trainer's pthread build. loom/sdk/blas.hpp asks the loaded one at run
# time whether concurrent calls are safe and makes calls take turns when they are not.
# loom_blas_runpath(TARGET [SERIAL]) puts the build's directory in an installed binary's
# RUNPATH (the build tree gets it from the link line).
set(loom_blas_arch_lib /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE})
find_path(LOOM_CBLAS_INCLUDE_DIR cblas.h
          PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-pthread NO_DEFAULT_PATH)
find_library(LOOM_OPENBLAS_PTHREAD NAMES openblas PATHS ${loom_blas_arch_lib}/openblas-pthread
             NO_DEFAULT_PATH)
find_library(LOOM_OPENBLAS_SERIAL NAMES openblas PATHS ${loom_blas_arch_lib}/openblas-serial
             NO_DEFAULT_PATH)
foreach(var LOOM_CBLAS_INCLUDE_DIR LOOM_OPENBLAS_PTHREAD LOOM_OPENBLAS_SERIAL)
  if(NOT ${var})
    message(FATAL_ERROR "Loom needs OpenBLAS's pthread and serial builds (Debian: "
            "libopenblas-pthread-dev libopenblas-serial-dev; scripts/install-deps.sh installs "
            "them); ${var} was not found. Elsewhere, set LOOM_CBLAS_INCLUDE_DIR, "
            "LOOM_OPENBLAS_PTHREAD and LOOM_OPENBLAS_SERIAL to a cblas.h folder and the two "
            "libopenblas.so files.")
  endif()
endforeach()

add_library(loom_blas INTERFACE)
target_include_directories(loom_blas SYSTEM INTERFACE ${LOOM_CBLAS_INCLUDE_DIR}
                           ${PROJECT_SOURCE_DIR}/sdk/include)
target_link_libraries(loom_blas INTERFACE ${LOOM_OPENBLAS_PTHREAD})
add_library(loom_blas_serial INTERFACE)
target_include_directories(loom_blas_serial SYSTEM INTERFACE ${LOOM_CBLAS_INCLUDE_DIR}
                           ${PROJECT_SOURCE_DIR}/sdk/include)
target_link_libraries(loom_blas_serial INTERFACE ${LOOM_OPENBLAS_SERIAL})

function(loom_blas_runpath target)
  set(lib ${LOOM_OPENBLAS_PTHREAD})
  if(ARGV1 STREQUAL "SERIAL")
    set(lib ${LOOM_OPENBLAS_SERIAL})
  endif()
  get_filename_component(dir "${lib}" DIRECTORY)
  set_property(TARGET ${target} APPEND PROPERTY INSTALL_RPATH "${dir}")
endfunction()
