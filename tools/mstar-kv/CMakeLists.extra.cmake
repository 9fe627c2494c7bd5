# Extra sources of the mstar-kv CLI, added by the subcommands that need them.
# Several subcommands edit this file: keep each block self-contained.

# `mstar-kv bench` (tools/mstar-kv/cmd_bench.cpp and its bench_* helpers).
if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/cmd_bench.cpp)
  target_sources(mstar-kv PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/bench_external.cpp
    ${CMAKE_CURRENT_LIST_DIR}/bench_proc.cpp
    ${CMAKE_CURRENT_LIST_DIR}/bench_report.cpp
    ${CMAKE_CURRENT_LIST_DIR}/bench_run.cpp
    ${CMAKE_CURRENT_LIST_DIR}/bench_workload.cpp)
endif()

# `mstar-kv soak`: page reuse and lease expiry in its prefill processes.
if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/cmd_soak.cpp)
  target_sources(mstar-kv PRIVATE ${CMAKE_CURRENT_LIST_DIR}/soak_prefill.cpp
                                 ${CMAKE_CURRENT_LIST_DIR}/soak_decode.cpp
                                 ${CMAKE_CURRENT_LIST_DIR}/soak_supervisor.cpp)
endif()

# `mstar-kv demo` (tools/mstar-kv/cmd_demo.cpp and its demo_* helpers).
if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/cmd_demo.cpp)
  target_sources(mstar-kv PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/demo_baseline.cpp
    ${CMAKE_CURRENT_LIST_DIR}/demo_layerwise.cpp
    ${CMAKE_CURRENT_LIST_DIR}/demo_proc.cpp)
  # The demo's memcpy baseline reads the prefill's real memory when the shm
  # engine is built; otherwise it copies from a private buffer.
  if(TARGET mstar_kv_engine_shm)
    target_compile_definitions(mstar-kv PRIVATE MSTAR_KV_DEMO_SHM=1)
  endif()
endif()

# `mstar-kv serve` / `pull` (tools/mstar-kv/cmd_serve_pull.cpp): the HTTP
# control plane's server is Debian's libmicrohttpd (libmicrohttpd-dev; epoll,
# bounded connections, see http_server.hpp), pull's client cpp-httplib
# (libcpp-httplib-dev). Without both the two subcommands are left out.
if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/cmd_serve_pull.cpp)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(MSTAR_KV_HTTPLIB QUIET IMPORTED_TARGET cpp-httplib)
    pkg_check_modules(MSTAR_KV_MHD QUIET IMPORTED_TARGET libmicrohttpd>=0.9.71)
  endif()
  if(MSTAR_KV_HTTPLIB_FOUND AND MSTAR_KV_MHD_FOUND)
    target_sources(mstar-kv PRIVATE
      ${CMAKE_CURRENT_LIST_DIR}/http_auth.cpp
      ${CMAKE_CURRENT_LIST_DIR}/http_server.cpp
      ${CMAKE_CURRENT_LIST_DIR}/serve_pull_layerwise.cpp
      ${CMAKE_CURRENT_LIST_DIR}/serve_pull_util.cpp)
    target_link_libraries(mstar-kv PRIVATE PkgConfig::MSTAR_KV_HTTPLIB PkgConfig::MSTAR_KV_MHD)
  else()
    message(STATUS "cpp-httplib or libmicrohttpd not found: mstar-kv serve/pull are not built")
    get_target_property(_mstar_kv_srcs mstar-kv SOURCES)
    list(REMOVE_ITEM _mstar_kv_srcs mstar-kv/cmd_serve_pull.cpp)
    set_property(TARGET mstar-kv PROPERTY SOURCES ${_mstar_kv_srcs})
    get_target_property(_mstar_kv_defs mstar-kv COMPILE_DEFINITIONS)
    list(REMOVE_ITEM _mstar_kv_defs MSTAR_KV_CMD_SERVE_PULL=1)
    set_property(TARGET mstar-kv PROPERTY COMPILE_DEFINITIONS ${_mstar_kv_defs})
  endif()
endif()
