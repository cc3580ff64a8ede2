# cmake -DROOT=<plugins folder> -P no_float_atomics.cmake: fails when a CUDA source under ROOT
# uses atomicAdd / atomicSub (a float reduction done that way changes bits run to run). An
# integer counter may, with "lint: integer atomic" on the same line.
file(GLOB_RECURSE sources "${ROOT}/*.cu" "${ROOT}/*.cuh")
set(found "")
foreach(f IN LISTS sources)
  file(STRINGS "${f}" lines REGEX "atomic(Add|Sub)[ \t]*\\(")
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "lint: integer atomic")
      string(APPEND found "${f}: ${line}\n")
    endif()
  endforeach()
endforeach()
if(found)
  message(FATAL_ERROR "atomic adds in CUDA code (use a fixed-order reduction):\n${found}")
endif()
list(LENGTH sources n)
message(STATUS "no atomic adds in ${n} CUDA files")
