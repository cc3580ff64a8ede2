# loom_cuda_sources(<out-var> <file.cu>...): the sources to compile for CUDA files.
# Normal builds (nvcc): the .cu files themselves, unchanged. With LOOM_CUDA_EMULATION=ON:
# for each file, a copy rewritten by tests/cuda_emulation/rewrite_launches.py at build time
# (<binary dir>/cuda_emulation/<file>.cpp), compiled as C++ with -ffp-contract=off (as nvcc's
# -fmad=false), the emulated CUDA headers first on the include path and the .cu file's own
# folder searched for its "quoted" includes.
function(loom_cuda_sources out_var)
  if(NOT LOOM_CUDA_EMULATION)
    set(${out_var} ${ARGN} PARENT_SCOPE)
    return()
  endif()
  set(result)
  foreach(cu IN LISTS ARGN)
    get_filename_component(src ${cu} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    get_filename_component(src_dir ${src} DIRECTORY)
    file(RELATIVE_PATH rel ${CMAKE_CURRENT_SOURCE_DIR} ${src})
    set(out ${CMAKE_CURRENT_BINARY_DIR}/cuda_emulation/${rel}.cpp)
    add_custom_command(OUTPUT ${out}
      COMMAND ${Python3_EXECUTABLE} ${LOOM_CUDA_EMULATION_REWRITER} ${src} ${out}
      DEPENDS ${src} ${LOOM_CUDA_EMULATION_REWRITER}
      COMMENT "CUDA emulation: rewriting ${rel}"
      VERBATIM)
    set_source_files_properties(${out} PROPERTIES
      COMPILE_OPTIONS "-ffp-contract=off;-iquote;${src_dir};-I${LOOM_CUDA_EMULATION_INCLUDE_DIR}")
    list(APPEND result ${out})
  endforeach()
  set(${out_var} ${result} PARENT_SCOPE)
endfunction()

# loom_target_cuda(<target> CUDA <file.cu|.cpp>... STUB <file.cpp>... [NEEDS <target>...]):
# a family's device entry points, one interface (a header of plain functions) built twice.
# With CUDA (LOOM_HAVE_CUDA and every NEEDS target present): the .cu files (through
# loom_cuda_sources, so the emulation build works too), CUDA::cudart and the NEEDS targets
# linked, and LOOM_HAVE_CUDA=1 defined for the target and its users. Without: the stub .cpp
# files instead, whose functions throw loom::sdk::throw_built_without_cuda. Call sites choose
# CPU or CUDA at run time (loom::sdk::is_cuda) and never test LOOM_HAVE_CUDA themselves.
function(loom_target_cuda target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "CUDA;STUB;NEEDS")
  set(with_cuda ${LOOM_HAVE_CUDA})
  foreach(need IN LISTS arg_NEEDS)
    if(NOT TARGET ${need})
      set(with_cuda OFF)
    endif()
  endforeach()
  if(with_cuda)
    # .cu files through loom_cuda_sources; host files that call the CUDA runtime as they are.
    set(cu_files ${arg_CUDA})
    list(FILTER cu_files INCLUDE REGEX "\\.cu$")
    set(host_files ${arg_CUDA})
    list(FILTER host_files EXCLUDE REGEX "\\.cu$")
    loom_cuda_sources(cuda_sources ${cu_files})
    target_sources(${target} PRIVATE ${cuda_sources} ${host_files})
    target_compile_definitions(${target} PUBLIC LOOM_HAVE_CUDA=1)
    target_link_libraries(${target} PUBLIC CUDA::cudart PRIVATE ${arg_NEEDS})
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 17 CUDA_VISIBILITY_PRESET hidden)
  else()
    target_sources(${target} PRIVATE ${arg_STUB})
  endif()
endfunction()
