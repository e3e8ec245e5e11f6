# What torch_opaque needs from torch's CMake package, in one file: included by
# CMakeLists.txt (the build) and, installed next to it, by
# torch_opaqueConfig.cmake (downstream projects' find_package(torch_opaque)).
#
# Note [A CUDA build of torch without the CUDA toolkit]: the torch wheels on
# PyPI from 2.14 on are CUDA builds. Their CMake package (Caffe2Config.cmake,
# public/cuda.cmake) looks for a complete CUDA toolkit (nvcc, headers, the
# runtime), enables the CUDA language and defines torch::cudart, which
# torch's imported targets link. torch_opaque compiles no CUDA code and calls
# no CUDA API: its ops run whatever kernels their tensors' device has, through
# the dispatcher, and libtorch_cuda is loaded by libtorch (by `import torch`
# in Python) whichever way. So before torch's package is read we define
# torch::cudart as an empty interface target. public/cuda.cmake starts with
# `if(TARGET torch::cudart) return()` (its include guard), so no toolkit is
# looked for, no CUDA language is enabled, no arch list or CUDA standard is
# needed; torch's targets still link libtorch_cuda and libc10_cuda (shipped in
# the wheel), whose own dependencies (libcudart etc., the nvidia-* wheels)
# the linker and loader find through those libraries' RUNPATH. The same CMake
# package works unchanged with a CPU build of torch, where nothing refers to
# torch::cudart. A project that compiles CUDA code of its own and wants
# torch's CUDA set-up sets TORCH_OPAQUE_TORCH_CUDA=ON (or finds Torch itself
# before torch_opaque, which then finds torch::cudart already defined).
macro(torch_opaque_prepare_torch)
  if(NOT TORCH_OPAQUE_TORCH_CUDA AND NOT TARGET torch::cudart)
    add_library(torch::cudart INTERFACE IMPORTED)
  endif()
endmacro()

# Note [torch's C++ standard]: code that includes torch's headers must be
# compiled with at least the C++ standard torch's CMake package asks for
# (2.14's c10 uses std::strong_ordering, a C++20 type). Releases say it in
# different ways: up to 2.14 as the CXX_STANDARD property of the imported
# `torch` target (which CMake does not pass on to targets that link it), from
# 2.15 as the usage requirement cxx_std_NN (or a -std=c++NN compile option
# when the compiler reports no compile features). This reads all three and
# gives the highest, 17 when torch says nothing. torch_opaque compiles with it
# and exports it as its own usage requirement (target_compile_features PUBLIC
# in CMakeLists.txt), so a downstream project builds with no standard of its
# own set, or with a lower one (the requirement raises it).
function(torch_opaque_torch_cxx_standard out_var)
  set(_std 17)
  if(TARGET torch)
    get_target_property(_prop torch CXX_STANDARD)
    get_target_property(_features torch INTERFACE_COMPILE_FEATURES)
    get_target_property(_options torch INTERFACE_COMPILE_OPTIONS)
    set(_said)
    if(_prop)
      list(APPEND _said "${_prop}")
    endif()
    foreach(_item IN LISTS _features _options)
      if(_item MATCHES "cxx_std_([0-9]+)")
        list(APPEND _said "${CMAKE_MATCH_1}")
      elseif(_item MATCHES "-std=[a-z]+\\+\\+([0-9]+)")
        list(APPEND _said "${CMAKE_MATCH_1}")
      endif()
    endforeach()
    foreach(_s IN LISTS _said)
      if(_s GREATER _std)
        set(_std "${_s}")
      endif()
    endforeach()
  endif()
  set(${out_var} "${_std}" PARENT_SCOPE)
endfunction()
