# Written for sm121-build's tests, with the semantics of vLLM's and flash-attention's
# cuda_archs_loose_intersection for plain and +PTX entries: for every target arch, the
# highest source arch not above it (an arch-specific X.Ya only for X.Y); a source given as
# X.Y+PTX keeps +PTX when picked.
function(cuda_archs_loose_intersection OUT SRC_ARCHS TGT_ARCHS)
  set(src "")
  set(ptx "")
  foreach(arch ${SRC_ARCHS})
    if(arch MATCHES "\\+PTX$")
      string(REPLACE "+PTX" "" arch "${arch}")
      list(APPEND ptx "${arch}")
    endif()
    list(APPEND src "${arch}")
  endforeach()
  list(SORT src COMPARE NATURAL ORDER ASCENDING)
  set(result "")
  foreach(tgt ${TGT_ARCHS})
    string(REGEX REPLACE "[af]$" "" tgt_plain "${tgt}")
    set(pick "")
    foreach(arch ${src})
      string(REGEX REPLACE "[af]$" "" arch_plain "${arch}")
      if(arch MATCHES "a$" AND NOT arch_plain VERSION_EQUAL tgt_plain)
        continue()  # arch-specific: only for that very arch
      endif()
      if(arch_plain VERSION_LESS_EQUAL tgt_plain)
        set(pick "${arch}")
      endif()
    endforeach()
    if(pick)
      list(APPEND result "${pick}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES result)
  foreach(arch ${ptx})
    if(arch IN_LIST result)
      list(REMOVE_ITEM result "${arch}")
      list(APPEND result "${arch}+PTX")
    endif()
  endforeach()
  set(${OUT} "${result}" PARENT_SCOPE)
endfunction()

# The per-source -gencode flags, in the shape of vLLM's and flash-attention's
# set_gencode_flags_for_srcs (cmake/utils.cmake): "X.Y" gives sm_XY cubins, "X.Y+PTX" sm_XY
# cubins and compute_XY PTX.
macro(set_gencode_flag_for_srcs)
  set(options)
  set(oneValueArgs ARCH CODE)
  set(multiValueArgs SRCS)
  cmake_parse_arguments(arg "${options}" "${oneValueArgs}"
                        "${multiValueArgs}" ${ARGN} )
  set(_FLAG -gencode arch=${arg_ARCH},code=${arg_CODE})
  set_property(
    SOURCE ${arg_SRCS}
    APPEND PROPERTY
    COMPILE_OPTIONS "$<$<COMPILE_LANGUAGE:CUDA>:${_FLAG}>"
  )
endmacro(set_gencode_flag_for_srcs)

macro(set_gencode_flags_for_srcs)
  set(options)
  set(oneValueArgs BUILD_PTX_FOR_ARCH)
  set(multiValueArgs SRCS CUDA_ARCHS)
  cmake_parse_arguments(arg "${options}" "${oneValueArgs}"
                        "${multiValueArgs}" ${ARGN} )
  foreach(_ARCH ${arg_CUDA_ARCHS})
    string(FIND "${_ARCH}" "+PTX" _HAS_PTX)
    if(NOT _HAS_PTX EQUAL -1)
      string(REPLACE "+PTX" "" _BASE_ARCH "${_ARCH}")
      string(REPLACE "." "" _STRIPPED_ARCH "${_BASE_ARCH}")
      set_gencode_flag_for_srcs(SRCS ${arg_SRCS} ARCH "compute_${_STRIPPED_ARCH}"
                                CODE "sm_${_STRIPPED_ARCH}")
      set_gencode_flag_for_srcs(SRCS ${arg_SRCS} ARCH "compute_${_STRIPPED_ARCH}"
                                CODE "compute_${_STRIPPED_ARCH}")
    else()
      string(REPLACE "." "" _STRIPPED_ARCH "${_ARCH}")
      set_gencode_flag_for_srcs(SRCS ${arg_SRCS} ARCH "compute_${_STRIPPED_ARCH}"
                                CODE "sm_${_STRIPPED_ARCH}")
    endif()
  endforeach()
endmacro()
