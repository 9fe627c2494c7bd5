# `mstar-kv demo` and `mstar-kv bench` with a prefill cache of another
# geometry (issue 12): a decode rank of TP=2 with 64-token NHD pages pulls
# its heads from a TP=1 prefill cache of 16-token HND pages over shm; every
# page is verified (the demo prints "result: OK", bench marks the case
# verified). Then a merge, which neither command does, is refused naming it.
# Usage: cmake -DMSTAR_KV=path -P geometry_cli.cmake
if(NOT MSTAR_KV)
  message(FATAL_ERROR "usage: cmake -DMSTAR_KV=path/to/mstar-kv -P geometry_cli.cmake")
endif()
set(geo --remote-tp 1 --local-tp 2 --local-rank 1 --remote-page-size 16 --page-size 64
        --remote-page-order hnd)
execute_process(
  COMMAND ${MSTAR_KV} demo --tokens 300 --repeat 2 ${geo}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT out MATCHES "result: OK" OR NOT out MATCHES "heads 4-8 of 8")
  message(FATAL_ERROR "mstar-kv demo with another prefill geometry: rc '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
execute_process(
  COMMAND ${MSTAR_KV} bench --engine shm --model llama3-8b --tokens 300 ${geo} --repeat 2
          --min-time 0.01 --threads 2 --no-external --json -
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT out MATCHES "tp1->2r1/p64<-p16" OR NOT out MATCHES "\"verified\": *true")
  message(FATAL_ERROR "mstar-kv bench with another prefill geometry: rc '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
execute_process(
  COMMAND ${MSTAR_KV} demo --tokens 64 --remote-tp 2 --local-tp 1
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "a merge reads several peers")
  message(FATAL_ERROR "a TP 2 -> 1 merge was not refused: rc '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
message(STATUS "demo and bench pulled across geometries:\n${out}")
