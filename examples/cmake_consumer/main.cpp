// Decodes one query row against a three-token paged KV on the CPU through the installed
// library, and checks the result against the softmax computed here.
#include <cmath>
#include <cstdio>
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/ops/attention.h"
#include "flashkv/plan/plan.h"

int main() {
  using namespace flashkv;
  const int kv_len = 3, dim = 4;
  std::vector<float> q(dim, 0.5f), k(kv_len * dim), v(kv_len * dim), out(dim, 0.0f);
  for (int i = 0; i < kv_len * dim; ++i) {
    k[i] = 0.1f * float(i % 7) - 0.2f;
    v[i] = float(i) / 8.0f;
  }
  std::vector<int32_t> indptr = {0, kv_len}, indices = {2, 0, 1};
  std::vector<float> lse(1);
  const Device cpu = Device::cpu();
  PagedKV kv;
  kv.k = TensorView(k.data(), DType::f32, {kv_len, 1, dim});
  kv.v = TensorView(v.data(), DType::f32, {kv_len, 1, dim});
  kv.indptr = TensorView(indptr.data(), DType::i32, {2});
  kv.indices = TensorView(indices.data(), DType::i32, {kv_len});

  const int32_t kv_lens[] = {kv_len};
  BatchShape shape;
  shape.batch_size = 1;
  shape.kv_len = kv_lens;
  shape.num_qo_heads = shape.num_kv_heads = 1;
  shape.head_dim_qk = shape.head_dim_v = dim;
  const DecodePlan plan = plan_decode(shape, device_info(cpu), PlanOptions{});
  Workspace ws(plan.layout.total_bytes, cpu);
  ws.upload(plan);
  paged_decode(plan, TensorView(q.data(), DType::f32, {1, 1, dim}), kv, AttentionOptions{},
               TensorView(out.data(), DType::f32, {1, 1, dim}),
               TensorView(lse.data(), DType::f32, {1, 1}), ws);

  // The same attention in plain loops (slots in the order of `indices`).
  double w[kv_len], sum = 0;
  for (int j = 0; j < kv_len; ++j) {
    double s = 0;
    for (int d = 0; d < dim; ++d) s += q[d] * k[indices[j] * dim + d];
    w[j] = std::exp(s / std::sqrt(double(dim)));
    sum += w[j];
  }
  double worst = 0;
  for (int d = 0; d < dim; ++d) {
    double o = 0;
    for (int j = 0; j < kv_len; ++j) o += w[j] / sum * v[indices[j] * dim + d];
    worst = std::fmax(worst, std::fabs(o - out[d]));
  }
  std::printf("consumer: paged_decode through flashkv::flashkv, max error %.2e\n", worst);
  return worst < 1e-5 ? 0 : 1;
}
