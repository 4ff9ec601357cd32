# Fails when a file includes a flashkv header of a layer above its own (cmake -DROOT=<source dir>
# -DSTAMP=<file written on success> -P check_layers.cmake). The layers, lowest first, and what
# each may include (docs/ARCHITECTURE.md):
#   core: core                  kvcache: + kvcache         plan: core, plan
#   kernels: core, plan, kernels                           ops: core, plan, ops (+ kernels in .cpp)
#   parallel (context parallelism): core, plan, ops, parallel
#   backend: core, kvcache, plan, ops, parallel, backend   reference: + reference
#   apps, bench/lib: the public layers + reference         python: the public layers
#   bench/*.cu (the standalone kernel benchmarks): + kernels
cmake_minimum_required(VERSION 3.24)
# Each rule: "<path prefixes, |-separated> = <layers it may include, comma-separated>"; the first
# rule whose prefix a file's path starts with applies.
set(_rules
  "include/flashkv/core/|core/ = core"
  "include/flashkv/kvcache/|kvcache/ = core,kvcache"
  "include/flashkv/plan/|plan/ = core,plan"
  "kernels/ = core,plan,kernels"
  "include/flashkv/ops/ = core,plan,ops"
  "ops/ = core,plan,ops,kernels"
  "include/flashkv/backend/|backend/ = core,kvcache,plan,ops,parallel,backend"
  "include/flashkv/parallel/|parallel/ = core,plan,ops,parallel"
  "reference/ = core,kvcache,plan,ops,parallel,backend,reference"
  "apps/|bench/lib/|tests/|fuzz/ = core,kvcache,plan,ops,backend,parallel,reference"
  "python/ = core,kvcache,plan,ops,parallel,backend"
  "bench/ = core,kvcache,plan,ops,backend,kernels")
file(GLOB_RECURSE _files RELATIVE ${ROOT}
  ${ROOT}/include/*.h ${ROOT}/core/* ${ROOT}/kvcache/* ${ROOT}/plan/* ${ROOT}/ops/*
  ${ROOT}/backend/* ${ROOT}/parallel/* ${ROOT}/reference/* ${ROOT}/kernels/* ${ROOT}/apps/*
  ${ROOT}/bench/*
  ${ROOT}/python/*.cpp ${ROOT}/python/*.h)
list(FILTER _files INCLUDE REGEX "\\.(h|cpp|cu|cuh|in)$")
set(_errors "")
foreach(f ${_files})
  set(_allowed "")
  foreach(rule ${_rules})
    string(REGEX MATCH "^([^ ]+) = (.+)$" _ "${rule}")
    set(_prefixes "${CMAKE_MATCH_1}")
    set(_allowed_text "${CMAKE_MATCH_2}")
    if(f MATCHES "^(${_prefixes})")
      string(REPLACE "," ";" _allowed "${_allowed_text}")
      break()
    endif()
  endforeach()
  if(_allowed STREQUAL "")
    continue()
  endif()
  file(STRINGS ${ROOT}/${f} _includes REGEX "^[ \t]*#[ \t]*include[ \t]+\"flashkv/")
  foreach(line ${_includes})
    string(REGEX REPLACE "^.*\"flashkv/([a-z_]+)/.*$" "\\1" _layer "${line}")
    if(NOT _layer IN_LIST _allowed)
      string(APPEND _errors "  ${f}: includes flashkv/${_layer}/ (this layer may include: ${_allowed_text})\n")
    endif()
  endforeach()
endforeach()
if(_errors)
  message(FATAL_ERROR "flashkv layer check: wrong-way includes\n${_errors}")
endif()
file(WRITE ${STAMP} "ok\n")
