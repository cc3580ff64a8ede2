# topk_router's tests (included by tests/routers/CMakeLists.txt).

# topk_router through the host: kept counts, selection against a sort reference, backward
# against finite differences, thread-count determinism, bad input, advance and state.
add_executable(loom_topk_router_tests topk_test.cpp)
target_link_libraries(loom_topk_router_tests PRIVATE loom loom_warnings GTest::gtest_main)
target_compile_options(loom_topk_router_tests PRIVATE -ffp-contract=off)
add_dependencies(loom_topk_router_tests loom_topk_router)
gtest_discover_tests(loom_topk_router_tests TEST_PREFIX "routers." DISCOVERY_TIMEOUT 60
                     PROPERTIES ENVIRONMENT "LOOM_PLUGIN_PATH=" TIMEOUT 120)

if(LOOM_HAVE_CUDA)
  # CPU and CUDA tensors through the host, bit for bit; skips without a CUDA device (runs
  # under the CUDA emulation, scripts/test.sh).
  add_executable(loom_topk_router_cuda_tests topk_cuda_test.cpp)
  target_link_libraries(loom_topk_router_cuda_tests PRIVATE loom loom_warnings GTest::gtest_main
                        CUDA::cudart)
  add_dependencies(loom_topk_router_cuda_tests loom_topk_router)
  gtest_discover_tests(loom_topk_router_cuda_tests TEST_PREFIX "routers." DISCOVERY_TIMEOUT 60
                       PROPERTIES ENVIRONMENT "LOOM_PLUGIN_PATH=" TIMEOUT 300)
endif()
