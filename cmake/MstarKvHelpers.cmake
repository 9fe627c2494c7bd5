# Warnings for every target of ours, never for users of the installed
# package: linked as $<BUILD_INTERFACE:mstar_kv_warnings> (MSTAR_KV_WARNINGS)
# so that it stays out of the exported targets. MSTAR_KV_WERROR makes them
# errors (the release and thread-safety presets set it; not asan: GCC 12 at
# -O1 with sanitizers warns maybe-uninitialized inside libstdc++'s
# std::regex). MSTAR_KV_THREAD_SAFETY (clang with libc++, whose std::mutex is
# annotated) checks the MSTAR_KV_GUARDED_BY / MSTAR_KV_REQUIRES annotations
# (include/mstar/kv/util/thread_annotations.hpp).
option(MSTAR_KV_WERROR "Treat warnings in mstar-kv's own code as errors" OFF)
option(MSTAR_KV_THREAD_SAFETY "Check lock annotations (clang -Wthread-safety, libc++)" OFF)
add_library(mstar_kv_warnings INTERFACE)
target_compile_options(mstar_kv_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${MSTAR_KV_WERROR}>>:-Werror>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${MSTAR_KV_THREAD_SAFETY}>>:-Wthread-safety>)
set(MSTAR_KV_WARNINGS $<BUILD_INTERFACE:mstar_kv_warnings>)

# mstar_kv_add_component(NAME SOURCES ... [LIBS ...]): a part engines share
# (rma, fault), target mstar_kv_<NAME>; it sees the public headers and the
# private src/ tree.
function(mstar_kv_add_component name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_library(mstar_kv_${name} STATIC ${ARG_SOURCES})
  target_include_directories(mstar_kv_${name}
    PRIVATE ${PROJECT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(mstar_kv_${name} PUBLIC mstar_kv_core ${ARG_LIBS}
                        PRIVATE ${MSTAR_KV_WARNINGS})
  set_property(GLOBAL APPEND PROPERTY MSTAR_KV_INSTALL_TARGETS mstar_kv_${name})
endfunction()

# mstar_kv_add_engine(NAME SOURCES ... [LIBS ...]): one engine, one target,
# mstar_kv_engine_<NAME>, built from src/engines/<NAME>; registered (unless
# local_only, which is always there) so that the factory may create it.
function(mstar_kv_add_engine name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_library(mstar_kv_engine_${name} STATIC ${ARG_SOURCES})
  target_include_directories(mstar_kv_engine_${name}
    PRIVATE ${PROJECT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(mstar_kv_engine_${name}
    PUBLIC mstar_kv_core ${ARG_LIBS} PRIVATE ${MSTAR_KV_WARNINGS})
  if(NOT name STREQUAL "local_only")
    set_property(GLOBAL APPEND PROPERTY MSTAR_KV_ENGINES ${name})
  endif()
  set_property(GLOBAL APPEND PROPERTY MSTAR_KV_INSTALL_TARGETS mstar_kv_engine_${name})
endfunction()
