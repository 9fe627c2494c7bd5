# The development benchmark's NIXL peer row (bench/mstar-kv-bench/nixl_peer.py): with
# NIXL installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1) the row
# has a GB/s figure (its script verified every byte read); without it the row
# is skipped and names the missing package. Either way the run succeeds.
# Usage: cmake -DMSTAR_KV_BENCH=path -P peers_nixl.cmake
if(NOT MSTAR_KV_BENCH)
  message(FATAL_ERROR "usage: cmake -DMSTAR_KV_BENCH=path/to/mstar-kv-bench -P peers_nixl.cmake")
endif()
execute_process(
  COMMAND ${MSTAR_KV_BENCH} --engine peers --mooncake-duration 1 --repeat 1 --quiet
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mstar-kv-bench exited with '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
message(STATUS "mstar-kv-bench output:\n${out}")
execute_process(COMMAND python3 -c "import nixl._api" RESULT_VARIABLE no_nixl
                OUTPUT_QUIET ERROR_QUIET)
if(no_nixl EQUAL 0)
  if(NOT out MATCHES "\nnixl_ucx_tcp +raw/64KiB/b128 +[0-9]+\\.[0-9][0-9] ")
    message(FATAL_ERROR "NIXL is installed but the bench has no measured nixl_ucx_tcp row")
  endif()
else()
  if(NOT out MATCHES "skipped +nixl_ucx_tcp +raw/64KiB/b128: NIXL: NIXL is not installed")
    message(FATAL_ERROR "NIXL is not installed, but the bench does not say so in its row")
  endif()
endif()
