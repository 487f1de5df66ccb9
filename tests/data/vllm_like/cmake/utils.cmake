# Written for sm121-build's tests: the guard function with the semantics of recent vLLM
# releases, as measured with cmake -P on the real sdists:
#   "X.Yf"  -> every requested arch of major X with minor >= Y, as the plain arch
#   "X.Ya"  -> the requested arch X.Ya, or X.Y when X.Y is requested plainly... only if equal
#   "X.Y"   -> X.Y when requested
function(cuda_archs_loose_intersection OUT SRC_ARCHS TGT_ARCHS)
  set(result "")
  foreach(src ${SRC_ARCHS})
    string(REGEX MATCH "^([0-9]+)\\.([0-9]+)([af]?)$" _m "${src}")
    set(smaj "${CMAKE_MATCH_1}")
    set(smin "${CMAKE_MATCH_2}")
    set(skind "${CMAKE_MATCH_3}")
    foreach(tgt ${TGT_ARCHS})
      string(REGEX MATCH "^([0-9]+)\\.([0-9]+)([af]?)$" _t "${tgt}")
      set(tmaj "${CMAKE_MATCH_1}")
      set(tmin "${CMAKE_MATCH_2}")
      set(tkind "${CMAKE_MATCH_3}")
      if(skind STREQUAL "f" AND tmaj EQUAL smaj AND NOT tmin LESS smin)
        list(APPEND result "${tmaj}.${tmin}${tkind}")
      elseif(skind STREQUAL "a" AND tmaj EQUAL smaj AND tmin EQUAL smin)
        list(APPEND result "${tmaj}.${tmin}a")
      elseif(skind STREQUAL "" AND "${src}" STREQUAL "${tmaj}.${tmin}")
        list(APPEND result "${src}")
      endif()
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES result)
  set(${OUT} "${result}" PARENT_SCOPE)
endfunction()

# "12.1;12.1a" -> "121-real;121a-real" for CMAKE_CUDA_ARCHITECTURES.
function(cuda_archs_to_cmake OUT ARCHS)
  set(result "")
  foreach(arch ${ARCHS})
    string(REPLACE "." "" arch "${arch}")
    list(APPEND result "${arch}-real")
  endforeach()
  set(${OUT} "${result}" PARENT_SCOPE)
endfunction()

function(define_gpu_extension_target NAME)
  cmake_parse_arguments(ARG "" "ARCHS" "SOURCES" ${ARGN})
  add_library(${NAME} SHARED ${ARG_SOURCES})
  cuda_archs_to_cmake(cmake_archs "${ARG_ARCHS}")
  set_target_properties(${NAME} PROPERTIES PREFIX "" SUFFIX ".abi3.so"
                        CUDA_ARCHITECTURES "${cmake_archs}")
endfunction()
