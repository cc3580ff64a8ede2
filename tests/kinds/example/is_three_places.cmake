# The example kind is three places: its C header, its SDK header and its line in a kind list,
# all in tests/kinds/example. Fails naming any file of the project itself (everything but
# tests/ and docs/) that spells the kind: the host, the SDK and the plugins never name it.
execute_process(
  COMMAND git -C ${ROOT} grep -l -e loom.example/1 -e LOOM_KIND_EXAMPLE -e loom_example_v1
          -e kinds/example.h -e kinds/example.hpp -- . ":!tests" ":!docs"
  OUTPUT_VARIABLE files RESULT_VARIABLE rc)
if(rc EQUAL 0)
  message(FATAL_ERROR "the example kind is named outside tests/kinds/example:\n${files}")
endif()
