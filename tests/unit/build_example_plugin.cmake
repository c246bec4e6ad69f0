# Run by the CTest tests "example_transport_plugin" (examples/transport_plugin, C++ on the SDK)
# and "example_transport_plugin_c" (examples/transport_plugin_c, plain C): builds the example
# out of tree exactly as a third party would, seeing only the include directory, then checks
# that the real loader accepts the result and moves bytes through it (ExamplePlugin.* in
# kvb_unit_tests). Fails with the failing step's output.
file(REMOVE_RECURSE ${BUILD_DIR})
execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR} -G ${GENERATOR}
          -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
          -DKVBRIDGE_INCLUDE_DIR=${ABI_INCLUDE_DIR}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the example plugin ${SOURCE_DIR} failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the example plugin ${SOURCE_DIR} failed (${rc})")
endif()
set(plugin ${BUILD_DIR}/libkvb_transport_${PLUGIN_NAME}.so)
if(NOT EXISTS ${plugin})
  message(FATAL_ERROR "the example build did not produce ${plugin}")
endif()
set(ENV{KVBRIDGE_EXAMPLE_PLUGIN} ${plugin})
set(ENV{KVBRIDGE_EXAMPLE_PLUGIN_NAME} ${PLUGIN_NAME})
execute_process(COMMAND ${UNIT_TESTS} --gtest_filter=ExamplePlugin.*
                OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the loader test of the example plugin failed (${rc})")
endif()
# A filter that matched nothing, or a skip, must not pass for a success.
if(NOT out MATCHES "\\[  PASSED  \\] [1-9]" OR out MATCHES "SKIPPED")
  message(FATAL_ERROR "ExamplePlugin.* did not run and pass")
endif()
