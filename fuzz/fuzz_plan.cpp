// Fuzzes the planner: any batch and options either plan (and the plan covers every query row and
// KV position exactly once per KV head, inside the workspace layout) or throw flashkv::Error.
#include <vector>

#include "flashkv/core/error.h"
#include "flashkv/plan/plan.h"
#include "fuzz_input.h"

using namespace flashkv;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const int32_t batch = static_cast<int32_t>(in.range(-2, 40));
  const bool decode = in.flag();
  std::vector<int32_t> kv_len(std::max(batch, 0)), qo_indptr(std::max(batch, 0) + 1, 0);
  for (int32_t i = 0; i < batch; ++i) {
    kv_len[i] = static_cast<int32_t>(in.range(-1, 5000));
    qo_indptr[i + 1] = qo_indptr[i] + static_cast<int32_t>(in.range(in.flag() ? -3 : 0, 300));
  }
  BatchShape b;
  b.batch_size = batch;
  b.kv_len = batch > 0 ? kv_len.data() : nullptr;
  b.qo_indptr = decode ? nullptr : qo_indptr.data();
  b.num_qo_heads = static_cast<int32_t>(in.range(0, 64));
  b.num_kv_heads = static_cast<int32_t>(in.range(0, 16));
  b.head_dim_qk = b.head_dim_v = static_cast<int32_t>(in.range(0, 256));
  b.page_size = static_cast<int32_t>(in.range(0, 32));
  b.causal = in.flag();
  b.window_left = static_cast<int32_t>(in.range(-1, 400));
  PlanOptions o;
  o.q_tile = static_cast<int32_t>(in.range(0, 200));
  o.enable_split_kv = in.flag();
  o.fixed_split_size = static_cast<int32_t>(in.range(0, 3000));
  o.kv_align = static_cast<int32_t>(in.range(0, 64));
  o.cuda_graph = in.flag();
  o.max_batch_size = static_cast<int32_t>(in.range(0, 64));
  o.max_num_tokens = static_cast<int32_t>(in.range(0, 20000));
  o.max_kv_len = static_cast<int32_t>(in.range(0, 6000));
  DeviceInfo dev;
  if (in.flag()) {
    dev.device = Device::cuda(0);
    dev.num_sms = static_cast<int>(in.range(0, 200));
  } else {
    dev.num_threads = static_cast<int>(in.range(0, 8));
  }
  Plan plan;
  try {
    if (decode) plan = plan_decode(b, dev, o);
    else plan = plan_prefill(b, dev, o);
  } catch (const Error&) {
    return 0;
  }
  // Every (row, position) a row can see appears once.
  std::vector<std::vector<int32_t>> seen(batch);
  for (int32_t r = 0; r < batch; ++r) {
    const int32_t q0 = decode ? r : qo_indptr[r], q1 = decode ? r + 1 : qo_indptr[r + 1];
    seen[r].assign(static_cast<size_t>(q1 - q0) * (kv_len[r] + 1), 0);
  }
  for (const WorkItem& it : plan.items) {
    if (it.request < 0 || it.request >= batch || it.kv_begin < 0 || it.kv_end > kv_len[it.request] ||
        it.kv_begin > it.kv_end)
      __builtin_trap();
    const int32_t q0 = decode ? it.request : qo_indptr[it.request];
    for (int32_t q = it.q_begin; q < it.q_begin + it.q_len; ++q)
      for (int32_t j = it.kv_begin; j < it.kv_end; ++j)
        if (++seen[it.request][static_cast<size_t>(q - q0) * (kv_len[it.request] + 1) + j] > 1) __builtin_trap();
  }
  if (plan.layout.partial_lse > plan.layout.total_bytes || plan.layout.plan_bytes > plan.layout.total_bytes)
    __builtin_trap();
  std::vector<uint8_t> buf(plan.layout.plan_bytes);
  serialize_plan(plan, buf.data());
  return 0;
}
