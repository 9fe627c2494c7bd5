# The development benchmark (mstar-kv-bench) sets a small request over TCP
# (one page of every layer of Llama-3-8B, 2 MiB, over ucx-tcp) beside one TCP
# round trip that carries the same bytes back, and says the ratio of the two
# p50s. No assertion on speed.
# Usage: cmake -DMSTAR_KV_BENCH=path -P peers_round_trip.cmake
if(NOT MSTAR_KV_BENCH)
  message(FATAL_ERROR "usage: cmake -DMSTAR_KV_BENCH=path/to/mstar-kv-bench -P peers_round_trip.cmake")
endif()
execute_process(
  COMMAND ${MSTAR_KV_BENCH} --engine ucx-tcp --model llama3-8b --tokens 16 --table contiguous
          --repeat 1 --mooncake-sizes none --quiet
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mstar-kv-bench exited with '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
message(STATUS "mstar-kv-bench output:\n${out}")
if(NOT out MATCHES "note: ucx-tcp llama3-8b/p16/t16/contiguous: p50 [0-9]+ us = [0-9]+\\.[0-9][0-9]x a TCP round trip of its 2 MiB \\([0-9]+ us\\)")
  message(FATAL_ERROR "no p50 beside a TCP round trip of the same 2 MiB")
endif()
