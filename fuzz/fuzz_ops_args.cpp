// Fuzzes argument validation of the CPU operators: random shapes, dtypes, indptr and indices.
// Every call either runs without touching memory out of bounds (AddressSanitizer watches) or
// throws flashkv::Error.
#include <vector>

#include "flashkv/core/buffer.h"
#include "flashkv/ops/attention.h"
#include "flashkv/ops/kv_ops.h"
#include "fuzz_input.h"

using namespace flashkv;

namespace {

const DType kTypes[] = {DType::f32, DType::bf16, DType::f16, DType::fp8_e4m3, DType::i32, DType::u8};

Tensor tensor(fuzz::Input& in, std::initializer_list<int64_t> shape, DType t) {
  Tensor x = Tensor::empty(shape, t);
  for (int64_t i = 0; i < static_cast<int64_t>(x.view().nbytes()); ++i)
    static_cast<uint8_t*>(x.data())[i] = static_cast<uint8_t>(i * 37 + 11);
  if (t == DType::i32)
    for (int64_t i = 0; i < x.numel(); ++i) x.ptr<int32_t>()[i] = static_cast<int32_t>(in.range(-3, 70));
  return x;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const int64_t B = in.range(0, 6), T = in.range(0, 20), slots = in.range(0, 80);
  const int64_t hq = in.range(1, 8), hkv = in.range(1, 4), d = in.range(1, 3) * 16;
  const DType qt = kTypes[in.range(0, 2)], kt = kTypes[in.range(0, 3)];
  Tensor q = tensor(in, {in.flag() ? T : B, hq, d}, qt);
  Tensor k = tensor(in, {slots, hkv, d}, kt), v = tensor(in, {slots, hkv, in.flag() ? d : d + 16}, kt);
  Tensor out = tensor(in, {q.size(0), hq, d}, qt);
  Tensor lse = tensor(in, {q.size(0), hq}, in.flag() ? DType::f32 : DType::bf16);
  Tensor indptr = tensor(in, {B + in.range(0, 1)}, DType::i32);
  Tensor indices = tensor(in, {in.range(0, 40)}, DType::i32);
  Tensor qo = tensor(in, {B + 1}, DType::i32);
  std::vector<int32_t> lens(B);
  for (auto& l : lens) l = static_cast<int32_t>(in.range(0, 30));
  BatchShape bs;
  bs.batch_size = static_cast<int32_t>(B);
  bs.kv_len = lens.data();
  bs.num_qo_heads = static_cast<int32_t>(hq);
  bs.num_kv_heads = static_cast<int32_t>(hkv);
  bs.head_dim_qk = bs.head_dim_v = static_cast<int32_t>(d);
  std::vector<int32_t> qo_host(B + 1);
  for (int64_t i = 0; i <= B; ++i) qo_host[i] = qo.ptr<int32_t>()[i];
  bs.qo_indptr = qo_host.data();
  AttentionOptions opt;
  opt.causal = in.flag();
  opt.window_left = static_cast<int>(in.range(-1, 10));
  try {
    const int which = static_cast<int>(in.range(0, 3));
    PagedKV kv{k, v, indptr, indices, TensorView(), 1};
    if (which == 0) {
      DecodePlan p = plan_decode(bs, device_info(Device::cpu()), {});
      Workspace ws(p.layout.total_bytes + 1, Device::cpu());
      ws.upload(p);
      paged_decode(p, q, kv, opt, out, lse, ws);
    } else if (which == 1) {
      PrefillPlan p = plan_prefill(bs, device_info(Device::cpu()), {});
      Workspace ws(p.layout.total_bytes + 1, Device::cpu());
      ws.upload(p);
      paged_prefill(p, q, qo, kv, opt, out, lse, ws);
    } else if (which == 2) {
      PrefillPlan p = plan_prefill(bs, device_info(Device::cpu()), {});
      Workspace ws(p.layout.total_bytes + 1, Device::cpu());
      ws.upload(p);
      ragged_prefill(p, q, k, v, qo, indptr, opt, out, lse, ws);
    } else {
      Tensor loc = tensor(in, {in.range(0, 10)}, DType::i32);
      Tensor knew = tensor(in, {loc.size(0), hkv, d}, qt);
      append_kv(knew, knew, loc, k, v);
    }
  } catch (const Error&) {
  }
  return 0;
}
