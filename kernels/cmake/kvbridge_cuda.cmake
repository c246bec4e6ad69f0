# KVBRIDGE_CUDA=AUTO|ON|OFF: whether kvbridge_kernels gets its CUDA path (kernels/cuda/).
#   AUTO  enables CUDA when CMake's check_language(CUDA) finds nvcc, else builds CPU-only;
#   ON    requires nvcc and fails the configure without it;
#   OFF   never looks (kvb_page_copy_cuda answers KVB_KERNEL_ERR_NOT_BUILT_WITH_CUDA).
# Sets KVBRIDGE_WITH_CUDA. Included from the top-level CMakeLists.txt (and kernels/ when built
# standalone), because enable_language(CUDA) must run in the top directory.
set(KVBRIDGE_CUDA AUTO CACHE STRING "Build the CUDA page-copy kernels: AUTO, ON or OFF")
set_property(CACHE KVBRIDGE_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${KVBRIDGE_CUDA}" _kvb_cuda_mode)
if(NOT _kvb_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "KVBRIDGE_CUDA is '${KVBRIDGE_CUDA}'; use AUTO, ON or OFF")
endif()

set(KVBRIDGE_WITH_CUDA OFF)
if(NOT _kvb_cuda_mode STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Ampere and Hopper machine code by default (plus PTX for later chips); override with
    # -DCMAKE_CUDA_ARCHITECTURES=... (e.g. "90" or "native").
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures for kernels/")
    endif()
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 cannot compile CUDA as C++20
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    if(CCACHE_PROGRAM)
      set(CMAKE_CUDA_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(KVBRIDGE_WITH_CUDA ON)
    message(STATUS "kvbridge: CUDA kernels ON (${CMAKE_CUDA_COMPILER}, "
                   "${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(_kvb_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "KVBRIDGE_CUDA=ON but CMake found no CUDA compiler: install the CUDA "
                        "toolkit and put nvcc on PATH, or set CMAKE_CUDA_COMPILER")
  else()
    message(STATUS "kvbridge: CUDA kernels OFF (KVBRIDGE_CUDA=AUTO and no nvcc found)")
  endif()
else()
  message(STATUS "kvbridge: CUDA kernels OFF (KVBRIDGE_CUDA=OFF)")
endif()
