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

# `mstar-kv demo` (tools/mstar-kv/cmd_demo.cpp and its demo_* helpers).
if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/cmd_demo.cpp)
  target_sources(mstar-kv PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/demo_baseline.cpp
    ${CMAKE_CURRENT_LIST_DIR}/demo_proc.cpp)
  # The demo's memcpy baseline reads the prefill's real memory when the shm
  # engine is built; otherwise it copies from a private buffer.
  if(TARGET mstar_kv_engine_shm)
    target_compile_definitions(mstar-kv PRIVATE MSTAR_KV_DEMO_SHM=1)
  endif()
endif()
