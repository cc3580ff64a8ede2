# loom-bench-router at toy shapes (both dtypes, the layer share on, --device all): exit 0,
# and every line kind of its header comment, with ratios that are positive numbers.
execute_process(
  COMMAND ${BENCH} --batch 2 --seq-lens 64,100 --channels 16 --reps 2 --layer-max-seq 128
          --dtypes fp32,bf16 --device all
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "loom-bench-router exited ${rc}:\n${out}\n${err}")
endif()
foreach(want "\"kind\":\"roof\"" "\"op\":\"gather\"" "\"op\":\"scatter\"" "\"kind\":\"select\""
        "\"kind\":\"layer\"" "\"device\":\"cuda\"" "\"dtype\":\"bf16\"" "\"seq_len\":100,\"kept\":50")
  string(FIND "${out}" "${want}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "no ${want} in the output:\n${out}")
  endif()
endforeach()
string(REGEX MATCHALL "\"ratio_to_roof\":[0-9.e+-]+" ratios "${out}")
list(LENGTH ratios n)
if(NOT n EQUAL 8)  # 2 dtypes x 2 lengths x (gather, scatter)
  message(FATAL_ERROR "expected 8 ratio_to_roof values, got ${n}:\n${out}")
endif()
foreach(r ${ratios})
  string(REGEX REPLACE ".*:" "" v "${r}")
  if(NOT v GREATER 0)
    message(FATAL_ERROR "ratio_to_roof ${v} is not positive:\n${out}")
  endif()
endforeach()
string(FIND "${err}" "ratio = the move's bandwidth / the roof's" at)
if(at EQUAL -1)
  message(FATAL_ERROR "no side-by-side table on stderr:\n${err}")
endif()
