# Runs `flashkv bench --cp NP --grid quick` under MPIRUN with NP ranks and checks that it exits 0,
# prints every case's one-rank and sharded rows (with the speed-up) and every rank's breakdown
# (local attention, communication, merge), and writes the JSON with one phase entry a rank.
#   cmake -DMPIRUN=mpirun -DNP=2 -DFLAGS=--oversubscribe -DFLASHKV=.../flashkv -DJSON=out.json
#         [-DARGS=--cp-exchange|all_to_all] [-DKV_PASS=ring] -DLIMIT=120 -P bench_cp.cmake
# FLAGS (mpirun's) and ARGS (more bench flags) are |-separated; KV_PASS, when given, is the
# kv_pass every case's JSON must report (the ARGS' --cp-kv-pass).
string(REPLACE "|" ";" _flags "${FLAGS}")
string(REPLACE "|" ";" _args "${ARGS}")
file(REMOVE "${JSON}")
execute_process(COMMAND ${MPIRUN} -np ${NP} ${_flags} ${FLASHKV} bench --device cpu --cp ${NP}
                        --grid quick --min-seconds 0 --roofline-mb 8 --json ${JSON} ${_args}
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err TIMEOUT ${LIMIT})
message(STATUS "mpirun returned: ${_rc}\n${_out}${_err}")
if(NOT "${_rc}" STREQUAL "0")
  message(FATAL_ERROR "flashkv bench --cp ${NP} failed: ${_rc}")
endif()
foreach(op decode extend)
  if(NOT _out MATCHES "\n${op} [^\n]* 1\n${op} [^\n]* ${NP} +[0-9.]+x\n")
    message(FATAL_ERROR "no one-rank and sharded rows (with the speed-up) of ${op}")
  endif()
endforeach()
math(EXPR _last "${NP} - 1")
foreach(rank RANGE ${_last})
  string(REGEX MATCHALL "sharded: rank ${rank}: local [0-9.]+ us \\([0-9]+%\\), comm [0-9.]+ us \\([0-9]+%\\), merge [0-9.]+ us \\([0-9]+%\\)"
         _lines "${_out}")
  list(LENGTH _lines _n)
  if(NOT _n EQUAL 2)
    message(FATAL_ERROR "expected rank ${rank}'s breakdown of both cases, found ${_n}")
  endif()
endforeach()
file(READ "${JSON}" _json)
string(JSON _ranks GET "${_json}" cp ranks)
string(JSON _cases LENGTH "${_json}" cp cases)
if(NOT _ranks EQUAL NP OR NOT _cases EQUAL 2)
  message(FATAL_ERROR "${JSON}: expected cp.ranks ${NP} and 2 cases, got ${_ranks} and ${_cases}")
endif()
foreach(i 0 1)
  string(JSON _phases LENGTH "${_json}" cp cases ${i} sharded phases)
  string(JSON _speedup GET "${_json}" cp cases ${i} speedup)
  string(JSON _kv_pass GET "${_json}" cp cases ${i} kv_pass)
  if(KV_PASS AND NOT _kv_pass STREQUAL KV_PASS)
    message(FATAL_ERROR "${JSON}: case ${i}: kv_pass ${_kv_pass}, expected ${KV_PASS}")
  endif()
  if(NOT _phases EQUAL NP OR NOT _speedup GREATER 0)
    message(FATAL_ERROR "${JSON}: case ${i}: ${_phases} phase entries, speed-up ${_speedup}")
  endif()
  # Every rank attends over its shard and joins the collectives.
  foreach(rank RANGE ${_last})
    string(JSON _local GET "${_json}" cp cases ${i} sharded phases ${rank} local_us)
    string(JSON _comm GET "${_json}" cp cases ${i} sharded phases ${rank} comm_us)
    if(NOT _local GREATER 0 OR NOT _comm GREATER 0)
      message(FATAL_ERROR "${JSON}: case ${i}, rank ${rank}: local ${_local} us, comm ${_comm} us")
    endif()
  endforeach()
endforeach()
