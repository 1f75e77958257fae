# torchmha_find_torch(): LibTorch for torchmha's build and for programs that use its CMake package
# (TorchMHAConfig.cmake includes this file). Defines the imported target `torch` and sets, in the
# caller's scope:
#   TORCH_INSTALL_PREFIX        the torch tree (lib/, include/, share/cmake/)
#   TORCHMHA_TORCH_VERSION      e.g. 2.14.1
#   TORCHMHA_TORCH_CUDA         the CUDA version torch was built with ("" for a CPU build)
#   TORCHMHA_CUDA_TOOLKIT       the CUDA toolkit's version where torch's CUDA package was used, else ""
#
# torch's own package (find_package(Torch)) is used wherever it can load. For a CUDA build of torch
# (the default `pip install torch`) it cannot without a complete CUDA toolkit: Caffe2Config.cmake
# stops with a fatal error that no setting avoids. torchmha needs no CUDA compiler or headers: its
# own kernels are CPU kernels, and CUDA tensors reach ATen's CUDA kernels through the dispatcher,
# in libtorch_cuda, which libtorch.so loads. So without a usable toolkit `torch` is defined from
# torch's files the way torch.utils.cpp_extension links a CPU extension: libtorch, libtorch_cpu and
# libc10 with torch's include directories.
#
# min and below bound the supported releases (torch>=min,<below). A `torch` target that the program
# already has (its own find_package(Torch) first) is kept.
#
# TORCHMHA_CUDA_TOOLKIT_MODE: AUTO (torch's package where a CUDA toolkit is found that it accepts),
# ON (insist on one), OFF (never).

set(TORCHMHA_CUDA_TOOLKIT_MODE "AUTO" CACHE STRING
    "With a CUDA build of torch: use torch's CMake package and a CUDA toolkit (ON), never (OFF), or where one is found (AUTO)")
set_property(CACHE TORCHMHA_CUDA_TOOLKIT_MODE PROPERTY STRINGS AUTO ON OFF)

function(_torchmha_torch_version config_dir out_var)
  include("${config_dir}/TorchConfigVersion.cmake")  # sets PACKAGE_VERSION, here in function scope
  set(${out_var} "${PACKAGE_VERSION}" PARENT_SCOPE)
endfunction()

# The CUDA version of a CUDA build, from the Python package's version.py or LibTorch's build-version.
function(_torchmha_torch_cuda prefix out_var)
  set(cuda "")
  if(EXISTS "${prefix}/lib/libtorch_cuda.so")
    set(cuda "unknown")
    if(EXISTS "${prefix}/version.py")
      file(STRINGS "${prefix}/version.py" line REGEX "^cuda")
      if(line MATCHES "'([0-9.]+)'")
        set(cuda "${CMAKE_MATCH_1}")
      endif()
    elseif(EXISTS "${prefix}/build-version")
      file(STRINGS "${prefix}/build-version" line LIMIT_COUNT 1)
      if(line MATCHES "\\+cu([0-9]+)([0-9])$")
        set(cuda "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
      endif()
    endif()
  endif()
  set(${out_var} "${cuda}" PARENT_SCOPE)
endfunction()

# torch's libraries as torch.utils.cpp_extension links a CPU extension (no CUDA toolkit needed).
function(_torchmha_torch_target prefix)
  foreach(lib torch torch_cpu c10)
    if(NOT EXISTS "${prefix}/lib/lib${lib}.so")
      message(FATAL_ERROR "torchmha: ${prefix}/lib/lib${lib}.so is missing: this torch installation is incomplete.")
    endif()
  endforeach()
  add_library(torch SHARED IMPORTED)
  set_target_properties(torch PROPERTIES
    IMPORTED_LOCATION "${prefix}/lib/libtorch.so"
    INTERFACE_INCLUDE_DIRECTORIES "${prefix}/include;${prefix}/include/torch/csrc/api/include"
    INTERFACE_LINK_LIBRARIES "${prefix}/lib/libtorch_cpu.so;${prefix}/lib/libc10.so")
endfunction()

# Whether torch's own CMake package loads with the CUDA toolkit that CMake's FindCUDAToolkit finds
# (it has more conditions than that module: a working nvcc, cuDNN, versions that agree...). Tried
# in a throw-away project, since its failures are fatal. Sets out_version (or "") and out_why.
function(_torchmha_probe_cuda_toolkit config_dir out_version out_why)
  set(${out_version} "" PARENT_SCOPE)
  find_package(CUDAToolkit QUIET)
  if(NOT CUDAToolkit_FOUND OR NOT CUDAToolkit_NVCC_EXECUTABLE)
    set(${out_why} "no CUDA toolkit with nvcc, its runtime headers (cuda_runtime.h) and libcudart was found" PARENT_SCOPE)
    return()
  endif()
  get_filename_component(root "${CUDAToolkit_BIN_DIR}/.." REALPATH)  # not a wrapper script's folder
  set(probe "${CMAKE_BINARY_DIR}/torchmha_cuda_probe")
  file(WRITE "${probe}/CMakeLists.txt"
    "cmake_minimum_required(VERSION 3.18)\nproject(probe LANGUAGES CXX)\nfind_package(Torch REQUIRED CONFIG)\n")
  execute_process(
    COMMAND "${CMAKE_COMMAND}" -S "${probe}" -B "${probe}/build" "-DTorch_DIR=${config_dir}"
            "-DCUDA_TOOLKIT_ROOT_DIR=${root}" "-DCMAKE_CUDA_COMPILER=${root}/bin/nvcc"
            "-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}"
    RESULT_VARIABLE failed OUTPUT_QUIET ERROR_VARIABLE errors)
  if(failed)
    string(REGEX MATCH "CMake Error[^\n]*\n[^\n]*" first "${errors}")
    set(${out_why} "the CUDA toolkit ${CUDAToolkit_VERSION} at ${root} does not satisfy torch's CMake package (${first})" PARENT_SCOPE)
    return()
  endif()
  set(TORCHMHA_CUDA_TOOLKIT_ROOT "${root}" PARENT_SCOPE)
  set(${out_version} "${CUDAToolkit_VERSION}" PARENT_SCOPE)
endfunction()

function(torchmha_find_torch min below)
  find_path(TORCHMHA_TORCH_CONFIG_DIR TorchConfig.cmake HINTS "${Torch_DIR}" PATH_SUFFIXES Torch share/cmake/Torch)
  if(NOT TORCHMHA_TORCH_CONFIG_DIR)
    message(FATAL_ERROR
      "torchmha needs LibTorch, and no TorchConfig.cmake was found. Put torch's CMake prefix on CMAKE_PREFIX_PATH:\n"
      "  -DCMAKE_PREFIX_PATH=\"$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')\"")
  endif()
  get_filename_component(prefix "${TORCHMHA_TORCH_CONFIG_DIR}/../../.." ABSOLUTE)
  _torchmha_torch_version("${TORCHMHA_TORCH_CONFIG_DIR}" version)
  if(version VERSION_LESS min OR NOT version VERSION_LESS below)
    message(FATAL_ERROR
      "torchmha supports torch >=${min},<${below}; found torch ${version} at ${prefix}. "
      "Install a torch in that range, or point CMAKE_PREFIX_PATH (Torch_DIR) at one.")
  endif()
  _torchmha_torch_cuda("${prefix}" cuda)

  set(toolkit "")
  if(TARGET torch)
    # the program found torch itself (it needed torch's package anyway): nothing to define
  elseif(NOT cuda)
    find_package(Torch REQUIRED CONFIG PATHS "${TORCHMHA_TORCH_CONFIG_DIR}" NO_DEFAULT_PATH)
  else()
    set(why "TORCHMHA_CUDA_TOOLKIT_MODE=OFF")
    if(NOT TORCHMHA_CUDA_TOOLKIT_MODE STREQUAL "OFF")
      _torchmha_probe_cuda_toolkit("${TORCHMHA_TORCH_CONFIG_DIR}" toolkit why)
    endif()
    if(toolkit)
      message(STATUS "torchmha: torch ${version} is a CUDA ${cuda} build; using the CUDA toolkit ${toolkit} at "
                     "${TORCHMHA_CUDA_TOOLKIT_ROOT} through torch's CMake package (TORCHMHA_CUDA_TOOLKIT_MODE=OFF builds without it)")
      set(CUDA_TOOLKIT_ROOT_DIR "${TORCHMHA_CUDA_TOOLKIT_ROOT}" CACHE PATH "The CUDA toolkit torch's CMake package uses")
      set(CMAKE_CUDA_COMPILER "${TORCHMHA_CUDA_TOOLKIT_ROOT}/bin/nvcc" CACHE FILEPATH "nvcc of that toolkit")
      find_package(Torch REQUIRED CONFIG PATHS "${TORCHMHA_TORCH_CONFIG_DIR}" NO_DEFAULT_PATH)
    elseif(TORCHMHA_CUDA_TOOLKIT_MODE STREQUAL "ON")
      message(FATAL_ERROR "TORCHMHA_CUDA_TOOLKIT_MODE=ON, but ${why}. Point CMake at a complete toolkit with "
                          "-DCUDAToolkit_ROOT=<toolkit>, or use AUTO or OFF: torchmha builds without a toolkit.")
    else()
      message(STATUS "torchmha: torch ${version} is a CUDA ${cuda} build; building without a CUDA toolkit, which "
                     "torchmha does not need: CUDA tensors run through ATen's kernels in libtorch_cuda (${why})")
      _torchmha_torch_target("${prefix}")
    endif()
  endif()

  set(TORCH_INSTALL_PREFIX "${prefix}" PARENT_SCOPE)
  set(TORCHMHA_TORCH_VERSION "${version}" PARENT_SCOPE)
  set(TORCHMHA_TORCH_CUDA "${cuda}" PARENT_SCOPE)
  set(TORCHMHA_CUDA_TOOLKIT "${toolkit}" PARENT_SCOPE)
endfunction()
