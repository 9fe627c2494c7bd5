# Installs the build tree into a scratch prefix, then configures, builds and
# runs a consumer that uses find_package(mstar_kv) and links mstar::kv.
# -DBUILD_DIR=<build tree> -DSOURCE_DIR=<tests/install> -DWORK_DIR=<scratch>
# -DBUILT_ENGINES=<engines built, comma-separated: local,shm,...>
# -DCONSUMER_CXX_FLAGS / -DCONSUMER_LINKER_FLAGS: the build tree's (sanitizers)
cmake_minimum_required(VERSION 3.22)  # policies of script mode (IN_LIST)
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()

# Only the headers of built engines are installed (a consumer including
# another would fail to link); every other public header is.
string(REPLACE "," ";" built "${BUILT_ENGINES}")
set(inc ${WORK_DIR}/prefix/include/mstar/kv)
foreach(engine shm ucx mooncake cuda_ipc)
  if(engine IN_LIST built AND NOT EXISTS ${inc}/engines/${engine}.hpp)
    message(FATAL_ERROR "engine ${engine} is built but engines/${engine}.hpp was not installed")
  elseif(NOT engine IN_LIST built AND EXISTS ${inc}/engines/${engine}.hpp)
    message(FATAL_ERROR "engine ${engine} is not built but engines/${engine}.hpp was installed")
  endif()
endforeach()
# One header of each layer's folder, the umbrella and the front door.
foreach(header kv.hpp manager.hpp util/status.hpp core/descriptor.hpp engines/local_only.hpp
               engines/fault_injection.hpp testing/pattern.hpp)
  if(NOT EXISTS ${inc}/${header})
    message(FATAL_ERROR "${header} was not installed")
  endif()
endforeach()

# The consumer checks mstar_kv_ENGINES and the components (CMakeLists.txt).
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/consumer -B ${WORK_DIR}/build
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
                        -DEXPECT_ENGINES=${BUILT_ENGINES}
                        "-DCMAKE_CXX_FLAGS=${CONSUMER_CXX_FLAGS}"
                        "-DCMAKE_EXE_LINKER_FLAGS=${CONSUMER_LINKER_FLAGS}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer failed:\n${out}")
endif()
message("${out}")
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
# The engines the package named are those the library reports at run time.
string(REPLACE "," " " expect_line "${BUILT_ENGINES}")
if(NOT out MATCHES "engines: ${expect_line}\n")
  message(FATAL_ERROR "built_engines() at run time is not '${expect_line}':\n${out}")
endif()

# A required component that is no built engine fails find_package, naming it.
set(probe ${WORK_DIR}/probe)
file(MAKE_DIRECTORY ${probe})
file(WRITE ${probe}/CMakeLists.txt
     "cmake_minimum_required(VERSION 3.22)\nproject(p CXX)\n"
     "find_package(mstar_kv REQUIRED COMPONENTS carrier_pigeon)\n")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${probe} -B ${probe}/build
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0 OR NOT out MATCHES "built without the engine\\(s\\) carrier_pigeon")
  message(FATAL_ERROR "find_package(mstar_kv COMPONENTS carrier_pigeon) did not fail (${rc}):\n${out}")
endif()
file(REMOVE_RECURSE ${WORK_DIR})
