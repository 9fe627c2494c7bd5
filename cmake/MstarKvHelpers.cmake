# Warnings for every target of ours (not for users of the installed package).
add_library(mstar_kv_warnings INTERFACE)
target_compile_options(mstar_kv_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor>)

# mstar_kv_add_engine(NAME SOURCES ... [LIBS ...]): one engine, one target.
# The target is mstar_kv_engine_<NAME>; it sees the public headers and the
# private src/ tree, and is registered so that the factory may create it.
function(mstar_kv_add_engine name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_library(mstar_kv_engine_${name} STATIC ${ARG_SOURCES})
  target_include_directories(mstar_kv_engine_${name}
    PRIVATE ${PROJECT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(mstar_kv_engine_${name}
    PUBLIC mstar_kv_core ${ARG_LIBS} PRIVATE mstar_kv_warnings)
  if(NOT name STREQUAL "local_only" AND NOT name STREQUAL "rma" AND NOT name STREQUAL "fault")
    set_property(GLOBAL APPEND PROPERTY MSTAR_KV_ENGINES ${name})
  endif()
  set_property(GLOBAL APPEND PROPERTY MSTAR_KV_INSTALL_TARGETS mstar_kv_engine_${name})
endfunction()
