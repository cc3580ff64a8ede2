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
