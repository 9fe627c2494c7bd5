# `mstar-kv bench --epoch-ab` on the shm engine's tiny cases: the run
# succeeds (bytes verified through the epoch-checked path) and prints the
# checked and unchecked bandwidth of every case. No assertion on speed.
# Usage: cmake -DMSTAR_KV=path -P bench_epoch_ab.cmake
if(NOT MSTAR_KV)
  message(FATAL_ERROR "usage: cmake -DMSTAR_KV=path/to/mstar-kv -P bench_epoch_ab.cmake")
endif()
execute_process(
  COMMAND ${MSTAR_KV} bench --engine shm --suite tiny --epoch-ab --repeat 2 --min-time 0.01
          --threads 2 --quiet
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mstar-kv bench --epoch-ab exited with '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
string(REGEX MATCHALL "shm +[^\n]* on [0-9.]+ GB/s, off [0-9.]+ GB/s: cost [-+][0-9.]+%" lines "${out}")
list(LENGTH lines n)
if(n LESS 1)
  message(FATAL_ERROR "no 'page epoch checks' lines in:\n${out}")
endif()
message(STATUS "${n} cases measured with and without page epoch checks:\n${out}")
