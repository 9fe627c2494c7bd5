# `mstar-kv demo` and `mstar-kv bench` with a prefill cache of another
# geometry: a decode rank of TP=2 with 64-token NHD pages pulls
# its heads from a TP=1 prefill cache of 16-token HND pages over shm; every
# page is verified (the demo prints "result: OK", bench marks the case
# verified); the same with layer_page caches on either side. Then a merge,
# which neither command does, and an unknown cache order are refused naming
# them.
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
          --min-time 0.01 --threads 2 --json -
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT out MATCHES "tp1->2r1/p64<-p16" OR NOT out MATCHES "\"verified\": *true")
  message(FATAL_ERROR "mstar-kv bench with another prefill geometry: rc '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
# The third cache order, [layer][page][k|v] (upstream mstar's [L, P, 2, T,
# H, D]), on either side, with the same change of geometry.
execute_process(
  COMMAND ${MSTAR_KV} demo --tokens 300 --repeat 2 ${geo} --cache-order layer_page
          --remote-cache-order page
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT out MATCHES "result: OK" OR NOT out MATCHES "layer-page-major")
  message(FATAL_ERROR "mstar-kv demo into a layer_page cache: rc '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
execute_process(
  COMMAND ${MSTAR_KV} bench --engine shm --model llama3-8b --tokens 300 ${geo} --repeat 2
          --min-time 0.01 --threads 2 --json - --cache-order layer
          --remote-cache-order layer_page
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT out MATCHES "layer<-layer_page" OR NOT out MATCHES "\"verified\": *true")
  message(FATAL_ERROR "mstar-kv bench from a layer_page cache: rc '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
execute_process(
  COMMAND ${MSTAR_KV} demo --tokens 64 --cache-order layer-page
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "unknown cache order 'layer-page' \\(expected layer, page or layer_page\\)")
  message(FATAL_ERROR "an unknown cache order was not refused by name: rc '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
execute_process(
  COMMAND ${MSTAR_KV} demo --tokens 64 --remote-tp 2 --local-tp 1
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "a merge reads several peers")
  message(FATAL_ERROR "a TP 2 -> 1 merge was not refused: rc '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
message(STATUS "demo and bench pulled across geometries:\n${out}")
