# Run by the CTest test Install.PackageAndExamplePlugin (tests/install/CMakeLists.txt):
#  1. `cmake --install` the build into PREFIX (under the build directory) and check the
#     package's files are there;
#  2. configure examples/transport_plugin with only CMAKE_PREFIX_PATH=PREFIX (so through
#     find_package(kvbridge), not -DKVBRIDGE_INCLUDE_DIR), build it, install it into PREFIX's
#     plugin directory, check it exports only kvb_plugin_query;
#  3. load that file with the real loader and move bytes through it (ExamplePlugin.* of
#     kvb_unit_tests);
#  4. build tests/install/consumer against PREFIX and run it without KVBRIDGE_PLUGIN_PATH: the
#     installed libkvbridge.so finds the installed plugins (the example among them), not the
#     build tree's, and moves bytes over the installed tcp plugin.
# Fails with the failing step's output.
function(run what)
  execute_process(COMMAND ${ARGN} OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(plugin_dir ${PREFIX}/${INSTALL_PLUGIN_DIR})

# 1. The package.
run("cmake --install ${BUILD_DIR} --prefix ${PREFIX}"
    ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX})
file(GLOB_RECURSE config LIST_DIRECTORIES false ${PREFIX}/*/kvbridgeConfig.cmake)
file(GLOB_RECURSE lib LIST_DIRECTORIES false ${PREFIX}/*/libkvbridge.so)
foreach(f config lib)
  if(NOT ${f})
    message(FATAL_ERROR "the install into ${PREFIX} has no ${f} file")
  endif()
endforeach()
foreach(f include/kvbridge/engine.h include/kvbridge/export.h
          include/kvbridge/plugin/sdk/transport.hpp ${INSTALL_PLUGIN_DIR}/libkvb_transport_tcp.so
          ${INSTALL_PLUGIN_DIR}/libkvb_transport_nccl.so)
  if(NOT EXISTS ${PREFIX}/${f})
    message(FATAL_ERROR "the install into ${PREFIX} has no ${f}")
  endif()
endforeach()
# Nothing of the Python wheel's layout (component python) in a plain install.
if(EXISTS ${PREFIX}/kvbridge)
  message(FATAL_ERROR "a plain install put the Python package's files into ${PREFIX}/kvbridge")
endif()

# 2. The example plugin, against the installed package only.
set(example_build ${WORK_DIR}/example)
run("configuring ${EXAMPLE_SOURCE} against ${PREFIX}"
    ${CMAKE_COMMAND} -S ${EXAMPLE_SOURCE} -B ${example_build} -G ${GENERATOR}
    -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_PREFIX_PATH=${PREFIX} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
if(NOT out MATCHES "kvbridge [0-9.]+ from ${PREFIX}/")
  message(FATAL_ERROR "the example did not use the package under ${PREFIX}:\n${out}")
endif()
run("building the example" ${CMAKE_COMMAND} --build ${example_build})
run("installing the example into ${PREFIX}"
    ${CMAKE_COMMAND} --install ${example_build} --prefix ${PREFIX})
set(example_so ${plugin_dir}/libkvb_transport_example_loopback.so)
if(NOT EXISTS ${example_so})
  message(FATAL_ERROR "installing the example did not produce ${example_so}")
endif()
run("the example plugin's exports" ${CMAKE_COMMAND} -E env NM=${NM}
    ${CHECK_EXPORTS} plugin ${example_so})

# 3. The real loader accepts it and moves bytes through it.
run("ExamplePlugin.* on ${example_so}" ${CMAKE_COMMAND} -E env
    KVBRIDGE_EXAMPLE_PLUGIN=${example_so} KVBRIDGE_EXAMPLE_PLUGIN_NAME=example_loopback
    ${UNIT_TESTS} --gtest_filter=ExamplePlugin.*)
# A filter that matched nothing, or a skip, must not pass for a success.
if(NOT out MATCHES "\\[  PASSED  \\] [1-9]" OR out MATCHES "SKIPPED")
  message(FATAL_ERROR "ExamplePlugin.* did not run and pass:\n${out}")
endif()

# 4. A program against the package, with the installed library and plugins.
set(consumer_build ${WORK_DIR}/consumer)
run("configuring ${CONSUMER_SOURCE} against ${PREFIX}"
    ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE} -B ${consumer_build} -G ${GENERATOR}
    -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_PREFIX_PATH=${PREFIX} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
run("building the consumer" ${CMAKE_COMMAND} --build ${consumer_build})
run("running the consumer" ${CMAKE_COMMAND} -E env --unset=KVBRIDGE_PLUGIN_PATH
    ${consumer_build}/kvb_install_consumer ${PREFIX} ${plugin_dir} ${BUILD_PLUGIN_DIR})
message("${out}")
