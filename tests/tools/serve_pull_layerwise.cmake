# `mstar-kv serve --layerwise` / `pull --layerwise` over shm and ucx: the
# server prefills the sequence layer by layer (write, sleep
# --prefill-ms-per-layer, mark ready) on the puller's request; the puller
# streams it in some rounds and pulls after the prefill in the others, and
# verifies every block of every round against the pattern. Checks the run
# succeeds, every round's blocks were verified (8 layers x K, V x 32 pages =
# 512 a round), and the demo's lines are printed (both end times, the
# fraction hidden, the owner's marking cost).
# No assertion on speed. Then what cannot work is refused with a clear
# error: --layerwise over an engine that is no engine, a --layerwise pull
# from a server without it, --prefill-ms-per-layer alone.
# Usage: cmake -DMSTAR_KV=path -DWORK=dir -P serve_pull_layerwise.cmake
# -DHAVE_UCX=ON when the ucx engine is built.
if(NOT MSTAR_KV OR NOT WORK)
  message(FATAL_ERROR "usage: cmake -DMSTAR_KV=path/to/mstar-kv -DWORK=dir -P serve_pull_layerwise.cmake")
endif()
file(MAKE_DIRECTORY ${WORK})

# serve in the background on a port of its own, then pull; serve exits
# once the puller marked the sequence done (--exit-when-done).
function(serve_and_pull engine serve_args pull_args out_var rc_var)
  string(RANDOM LENGTH 4 ALPHABET 0123456789 r)
  math(EXPR port "20000 + ${r} % 12000")
  # Emptied before serve starts: the wait below must not see the line a
  # previous run left there.
  set(log ${WORK}/serve_layerwise.log)
  execute_process(
    COMMAND sh -c ": > '${log}'
                   \"$0\" serve --engine ${engine} --listen 127.0.0.1:${port} --exit-when-done ${serve_args} > '${log}' 2>&1 &
                   pid=$!
                   i=0
                   while ! grep -q 'http://' '${log}'; do
                     i=$((i + 1)); [ $i -gt 300 ] && { cat '${log}'; kill $pid; exit 90; }
                     kill -0 $pid 2>/dev/null || { cat '${log}'; exit 91; }
                     sleep 0.1
                   done
                   \"$0\" pull --from 127.0.0.1:${port} ${pull_args}
                   rc=$?
                   [ $rc -eq 0 ] || kill $pid 2>/dev/null
                   wait $pid
                   echo '--- serve:'; cat '${log}'
                   exit $rc" ${MSTAR_KV}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
  set(${out_var} "${out}${err}" PARENT_SCOPE)
  set(${rc_var} "${rc}" PARENT_SCOPE)
endfunction()

foreach(engine shm ucx)
  if(engine STREQUAL "ucx" AND NOT HAVE_UCX)
    continue()
  endif()
  serve_and_pull(${engine} "--layerwise --prefill-ms-per-layer 1 --tokens 512 --layers 8"
                 "--layerwise --repeat 2" out rc)
  string(REGEX MATCHALL "round [1-4] (streamed|pulled): +all KV at decode [^\n]* verified 512 blocks"
         rounds "${out}")
  list(LENGTH rounds nrounds)
  if(NOT rc EQUAL 0 OR NOT nrounds EQUAL 4 OR NOT out MATCHES "result: OK"
     OR NOT out MATCHES "pull after prefill: all KV at decode +[0-9.]+ ms after prefill start"
     OR NOT out MATCHES "layer-wise streaming: all KV at decode +[0-9.]+ ms after prefill start"
     OR NOT out MATCHES "hidden +[0-9.]+% of the transfer"
     OR NOT out MATCHES "mark_layers_ready [0-9.]+ us per layer \\(mean of 32\\)"
     OR NOT out MATCHES "summary: layerwise stream"
     OR NOT out MATCHES "sequence 0 done")
    message(FATAL_ERROR "serve/pull --layerwise over ${engine}: rc '${rc}', ${nrounds} verified rounds\n${out}")
  endif()
  message(STATUS "serve/pull --layerwise over ${engine}:\n${out}")
endforeach()

execute_process(COMMAND ${MSTAR_KV} serve --engine nosuch --layerwise
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "--layerwise over engine 'nosuch': it has no readiness channel")
  message(FATAL_ERROR "serve --layerwise over an unknown engine was not refused: rc '${rc}'\n${out}${err}")
endif()
execute_process(COMMAND ${MSTAR_KV} serve --engine shm --prefill-ms-per-layer 2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "--prefill-ms-per-layer needs --layerwise")
  message(FATAL_ERROR "--prefill-ms-per-layer without --layerwise was not refused: rc '${rc}'\n${out}${err}")
endif()
serve_and_pull(shm "--tokens 64 --layers 2" "--layerwise" out rc)
if(rc EQUAL 0 OR NOT out MATCHES "this server runs without --layerwise")
  message(FATAL_ERROR "pull --layerwise from a server without it did not fail clearly: rc '${rc}'\n${out}")
endif()
