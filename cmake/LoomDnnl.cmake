# oneDNN (Debian's libdnnl-dev) for the CPU INT8 GEMM of the quantizers and their benchmark.
# Optional: without it the build goes on and that matmul reports it is missing.
#
# Debian's oneDNN package calls find_package(OpenCL REQUIRED) from its own config file, and
# QUIET does not reach that nested call: on a machine without OpenCL's development files
# (ocl-icd-opencl-dev, only a recommendation of libdnnl-dev) the configure step would stop
# there. So a config file that asks for OpenCL is only loaded when OpenCL is found first.
find_file(LOOM_DNNL_CONFIG NAMES dnnl-config.cmake dnnlConfig.cmake
          HINTS ${dnnl_DIR} PATHS ${CMAKE_PREFIX_PATH} ${CMAKE_SYSTEM_PREFIX_PATH}
          PATH_SUFFIXES lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/dnnl lib/cmake/dnnl
                        lib64/cmake/dnnl
          NO_DEFAULT_PATH)
set(LOOM_DNNL_FOUND OFF)
if(LOOM_DNNL_CONFIG)
  file(READ "${LOOM_DNNL_CONFIG}" loom_dnnl_config_text)
  set(loom_dnnl_loadable ON)
  if(loom_dnnl_config_text MATCHES "find_package\\(OpenCL")
    find_package(OpenCL QUIET)
    if(NOT OpenCL_FOUND)
      set(loom_dnnl_loadable OFF)
      message(WARNING "oneDNN's CMake package (${LOOM_DNNL_CONFIG}) needs OpenCL, which was "
                      "not found (Debian: ocl-icd-opencl-dev; scripts/install-deps.sh installs "
                      "it): the quantizers build without the CPU INT8 GEMM")
    endif()
  endif()
  if(loom_dnnl_loadable)
    find_package(dnnl CONFIG QUIET)
    set(LOOM_DNNL_FOUND ${dnnl_FOUND})
  endif()
endif()
if(NOT LOOM_DNNL_FOUND AND NOT LOOM_DNNL_CONFIG)
  message(WARNING "oneDNN (libdnnl-dev) not found: the quantizers build without the CPU INT8 "
                  "GEMM (W8A8 / W4A8 matmul); run scripts/install-deps.sh to add it")
endif()
