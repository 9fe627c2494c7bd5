# Installs the build tree into a scratch prefix, then configures, builds and
# runs a consumer that uses find_package(mstar_kv) and links mstar::kv.
# -DBUILD_DIR=<build tree> -DSOURCE_DIR=<tests/install> -DWORK_DIR=<scratch>
# -DCONSUMER_CXX_FLAGS / -DCONSUMER_LINKER_FLAGS: the build tree's (sanitizers)
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/consumer -B ${WORK_DIR}/build
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
                        "-DCMAKE_CXX_FLAGS=${CONSUMER_CXX_FLAGS}"
                        "-DCMAKE_EXE_LINKER_FLAGS=${CONSUMER_LINKER_FLAGS}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer failed:\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer failed:\n${out}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/c RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "descriptor [0-9]+ bytes")
  message(FATAL_ERROR "the consumer failed (${rc}):\n${out}")
endif()
file(REMOVE_RECURSE ${WORK_DIR})
