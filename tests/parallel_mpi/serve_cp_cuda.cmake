# Runs `flashkv serve --cp NP --device cuda --check` under MPIRUN with NP ranks, each on a GPU of
# its own through NCCL. On a host with at least NP GPUs the run must exit 0 (every rank's checks
# against the float64 reference and its invariants passed); on a host with fewer (but one), every
# rank must refuse with exit code 2 and the one-line error naming --cp and the GPU count, since
# NCCL does not allow two ranks on one GPU. Without a GPU the test prints "no GPU is visible"
# (CTest's SKIP_REGULAR_EXPRESSION).
#   cmake -DMPIRUN=mpirun -DNP=2 -DFLAGS=--oversubscribe -DFLASHKV=.../flashkv -DLIMIT=240
#         -P serve_cp_cuda.cmake
# FLAGS (mpirun's) are |-separated.
string(REPLACE "|" ";" _flags "${FLAGS}")
execute_process(COMMAND ${MPIRUN} -np ${NP} ${_flags} ${FLASHKV} serve --device cuda --cp ${NP}
                        --requests 16 --check --quiet
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err TIMEOUT ${LIMIT})
message(STATUS "mpirun returned: ${_rc}\n${_out}${_err}")
if(_err MATCHES "no GPU is visible")
  return()
endif()
if(_err MATCHES "--cp ${NP} --device cuda: ${NP} ranks run on this host, which has ([0-9]+) GPUs? for them; NCCL needs a GPU for each rank")
  if(NOT CMAKE_MATCH_1 LESS NP)
    message(FATAL_ERROR "refused although the host has ${CMAKE_MATCH_1} GPUs for ${NP} ranks")
  endif()
  if("${_rc}" STREQUAL "0")
    message(FATAL_ERROR "the ranks refused to share a GPU but mpirun reported success")
  endif()
  message(STATUS "fewer GPUs than ranks on this host: refused as expected")
  return()
endif()
if(NOT "${_rc}" STREQUAL "0")
  message(FATAL_ERROR "flashkv serve --cp ${NP} --device cuda failed: ${_rc}")
endif()
if(NOT _out MATCHES "context par  ${NP} ranks")
  message(FATAL_ERROR "no context-parallel line with ${NP} ranks in the report")
endif()
