// A rank that exits in the middle of a run: the last rank leaves (without MPI_Finalize) before
// the sharded decode's first collective, and the others must stop rather than wait forever,
// either with the communicator's timeout error (printed, exit code 3) or because the MPI runtime
// ends the job when it sees a rank exit. Run by the CTest entry flashkv_parallel_mpi_rank_exits,
// which checks that mpirun returns a failure well before its own time limit.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <vector>

#include "flashkv/parallel/context_parallel.h"
#include "flashkv/parallel/mpi.h"

namespace {

int run() {
  using namespace flashkv;
  parallel::CommOptions o;
  o.timeout_s = 3;
  auto comm = parallel::make_mpi_communicator(MPI_Comm_c2f(MPI_COMM_WORLD), o);
  const int hq = 4, hkv = 2, d = 64;
  parallel::CpDecodeShape shape;
  shape.kv_len = {64};
  shape.num_qo_heads = hq;
  shape.num_kv_heads = hkv;
  shape.head_dim_qk = shape.head_dim_v = d;
  shape.dtype = DType::f32;
  parallel::CpDecode cp(*comm, parallel::CpOptions{});
  cp.plan(shape);
  const int32_t local = cp.local_kv_len()[0];
  Tensor q = Tensor::empty({1, hq, d}, DType::f32);
  Tensor k = Tensor::empty({local, hkv, d}, DType::f32);
  Tensor v = Tensor::empty({local, hkv, d}, DType::f32);
  for (Tensor* t : {&q, &k, &v})
    for (int64_t i = 0; i < t->numel(); ++i) t->ptr<float>()[i] = 0.01f * static_cast<float>(i % 7);
  std::vector<int32_t> idx(local);
  std::iota(idx.begin(), idx.end(), 0);
  Tensor indptr = Tensor::from_i32({0, local}), indices = Tensor::from_i32(idx);
  PagedKV kv{k, v, indptr, indices, TensorView(), 1};
  Tensor out = Tensor::empty({1, hq, d}, DType::f32);
  if (comm->rank() == comm->size() - 1) {
    std::fprintf(stderr, "rank %d: exiting before the collective\n", comm->rank());
    std::_Exit(0);
  }
  try {
    cp.run(q, kv, AttentionOptions(), out, TensorView());
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d: flashkv::Error: %s\n", comm->rank(), e.what());
    std::_Exit(3);
  }
  std::fprintf(stderr, "rank %d: the decode returned although a rank had exited\n", comm->rank());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  try {
    return run();
  } catch (const std::exception& e) {  // a failure before the collective: not what is tested
    std::fprintf(stderr, "exit_rank: %s\n", e.what());
    return 2;
  }
}
