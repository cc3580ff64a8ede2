# Expert parallelism (plugins/moe/core/exchange.cpp) over the ucx transport, under mpirun with
# 2 and 4 ranks: the exchange's round trip with unequal counts, reduce_gradients, bad
# configurations and a silent rank, and the whole layer (layer.cpp) with ep 2 and 4 against
# one rank. Included from tests/moe/CMakeLists.txt.
if(TARGET loom_ucx AND TARGET loom_moe_core)
  find_program(LOOM_MPIRUN mpirun)
  # The silent-rank test is the last of moe_ep_exchange_test.cpp, which is linked last.
  add_executable(loom_moe_ep_tests ${CMAKE_CURRENT_LIST_DIR}/moe_ep_layer_test.cpp
                 ${CMAKE_CURRENT_LIST_DIR}/moe_ep_exchange_test.cpp)
  target_link_libraries(loom_moe_ep_tests PRIVATE loom loom_sdk loom_moe_core_internal GTest::gtest_main
                        loom_warnings)
  target_include_directories(loom_moe_ep_tests PRIVATE ${PROJECT_SOURCE_DIR}/tests/comm)
  add_dependencies(loom_moe_ep_tests loom_ucx loom_moe)
  set(LOOM_MOE_EP_TEST_ENV
    "LOOM_PLUGIN_PATH="
    "LOOM_LOG_LEVEL="
    "OMPI_MCA_rmaps_base_oversubscribe=1"
    "UCX_LOG_LEVEL=error"
    "LOOM_BOOTSTRAP_TIMEOUT=30")
  add_test(NAME moe.ep.np1 COMMAND loom_moe_ep_tests)
  set_tests_properties(moe.ep.np1 PROPERTIES TIMEOUT 60 ENVIRONMENT "${LOOM_MOE_EP_TEST_ENV}")
  if(LOOM_MPIRUN)
    foreach(np 2 4)
      add_test(NAME moe.ep.np${np}
        COMMAND ${LOOM_MPIRUN} --oversubscribe --allow-run-as-root -np ${np}
                $<TARGET_FILE:loom_moe_ep_tests>)
      set_tests_properties(moe.ep.np${np} PROPERTIES TIMEOUT 120 PROCESSORS ${np}
        ENVIRONMENT "${LOOM_MOE_EP_TEST_ENV}")
    endforeach()
  endif()
endif()

# The exchange on CUDA memory over the thread_comm test transport (ranks as threads, one
# device), natively and staged through the host; skips without a device, runs in the CUDA
# emulation pass.
if(LOOM_HAVE_CUDA AND TARGET loom_moe_core AND TARGET loom_test_plugin_thread_comm)
  add_executable(loom_moe_ep_cuda_tests ${CMAKE_CURRENT_LIST_DIR}/moe_ep_cuda_test.cpp)
  target_link_libraries(loom_moe_ep_cuda_tests PRIVATE loom loom_sdk loom_moe_core CUDA::cudart
                        GTest::gtest_main loom_warnings)
  target_include_directories(loom_moe_ep_cuda_tests PRIVATE
                             ${PROJECT_SOURCE_DIR}/tests/plugins/thread_comm)
  target_compile_definitions(loom_moe_ep_cuda_tests PRIVATE
                             LOOM_TEST_PLUGIN_DIR="${LOOM_TEST_PLUGIN_DIR}")
  add_dependencies(loom_moe_ep_cuda_tests loom_test_plugin_thread_comm)
  gtest_discover_tests(loom_moe_ep_cuda_tests TEST_PREFIX "moe.ep." DISCOVERY_TIMEOUT 60
                       PROPERTIES TIMEOUT 120 LABELS cuda ENVIRONMENT "LOOM_PLUGIN_PATH=")
endif()
