# Runs PROGRAM under MPIRUN with NP ranks (FLAGS: extra mpirun flags, |-separated) and checks that
# the run stops on its own with a failure: a rank of it exits early, so success is wrong, and so
# is still running after LIMIT seconds (the other ranks waiting forever).
#   cmake -DMPIRUN=mpirun -DNP=2 -DFLAGS=--oversubscribe -DPROGRAM=... -DLIMIT=60 -P expect_stop.cmake
string(REPLACE "|" ";" _flags "${FLAGS}")
execute_process(COMMAND ${MPIRUN} -np ${NP} ${_flags} ${PROGRAM}
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err TIMEOUT ${LIMIT})
message(STATUS "mpirun returned: ${_rc}\n${_out}${_err}")
if(_rc MATCHES "timeout")
  message(FATAL_ERROR "the ranks did not stop within ${LIMIT} s after one exited")
endif()
if("${_rc}" STREQUAL "0")
  message(FATAL_ERROR "mpirun reported success although a rank exited early")
endif()
