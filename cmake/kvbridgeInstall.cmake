# `cmake --install <build> [--prefix <dir>]`: the C++ package, for programs and out-of-tree
# plugins (find_package(kvbridge CONFIG), cmake/kvbridgeConfig.cmake.in).
#
#   <prefix>/lib/libkvbridge.so, libkvbridge_store.so       component runtime
#   <prefix>/lib/kvbridge/plugins/libkvb_*.so               component runtime
#   <prefix>/bin/kvbridge                                   component runtime
#   <prefix>/include/kvbridge/...                           component devel
#   <prefix>/lib/cmake/kvbridge/kvbridge{Config,ConfigVersion,Targets}.cmake   component devel
#
# The installed libkvbridge.so finds the installed plugins by default: the loader searches
# <dir of libkvbridge.so>/kvbridge/plugins (PluginRegistry::DefaultSearchPath), and never the
# build tree's plugins once an installed plugin directory sits next to it. The Python wheel's
# layout is the separate component "python" (csrc/bindings/CMakeLists.txt), installed only when
# asked for by name, as setup.py does.
include(CMakePackageConfigHelpers)

set(KVBRIDGE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvbridge)
set(KVBRIDGE_INSTALL_PLUGINDIR ${CMAKE_INSTALL_LIBDIR}/kvbridge/plugins)

# The installed libraries and the CLI find their siblings through $ORIGIN: the CLI in
# <prefix>/bin reaches <prefix>/lib, and in a wheel (kvbridge/bin/kvbridge, component python)
# the package directory kvbridge/ that holds the libraries.
set_target_properties(kvbridge kvbridge_store PROPERTIES INSTALL_RPATH "$ORIGIN")
set_target_properties(kvbridge_cli PROPERTIES
                      INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR};$ORIGIN/..")

install(TARGETS kvbridge kvbridge_store kvbridge_plugin_abi
  EXPORT kvbridgeTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT devel
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS kvbridge_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

# nccl is always built (NCCL and the driver are dlopen'ed) and opt-in: without NCCL or a GPU its
# probe says UNAVAILABLE and an engine with default transports goes on without it.
set(_kvb_installed_plugins kvb_transport_tcp kvb_transport_nccl kvb_storage_dram kvb_storage_ssd)
if(TARGET kvb_transport_ucx)
  list(APPEND _kvb_installed_plugins kvb_transport_ucx)
endif()
if(TARGET kvb_transport_verbs)
  list(APPEND _kvb_installed_plugins kvb_transport_verbs)
endif()
install(TARGETS ${_kvb_installed_plugins}
  LIBRARY DESTINATION ${KVBRIDGE_INSTALL_PLUGINDIR} COMPONENT runtime)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/csrc/include/kvbridge
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT devel
  FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")

install(EXPORT kvbridgeTargets
  NAMESPACE kvbridge::
  DESTINATION ${KVBRIDGE_INSTALL_CMAKEDIR} COMPONENT devel)
configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/kvbridgeConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/kvbridgeConfig.cmake
  INSTALL_DESTINATION ${KVBRIDGE_INSTALL_CMAKEDIR}
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR KVBRIDGE_INSTALL_PLUGINDIR)
# 0.x: a minor release may break the C++ API (the plugin ABI has its own versioning, abi.h).
write_basic_package_version_file(
  ${CMAKE_CURRENT_BINARY_DIR}/kvbridgeConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvbridgeConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/kvbridgeConfigVersion.cmake
  DESTINATION ${KVBRIDGE_INSTALL_CMAKEDIR} COMPONENT devel)
