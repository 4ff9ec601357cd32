#include "model_flags.h"

#include <algorithm>

namespace flashkv::app {

namespace {

// "(auto: 4 on a CPU, 32 on a GPU)", or "(auto: 2)" when both are the same.
std::string auto_note(int cpu, int gpu) {
  return cpu == gpu ? str_cat("(auto: ", cpu, ")")
                    : str_cat("(auto: ", cpu, " on a CPU, ", gpu, " on a GPU)");
}

}  // namespace

std::vector<FlagSpec> model_flags(const ModelDefaults& cpu, const ModelDefaults& gpu,
                                  const std::string& window) {
  return {
      {"--layers", "N", "attention layers " + auto_note(cpu.layers, gpu.layers), "auto"},
      {"--heads", "N", "query heads " + auto_note(cpu.heads, gpu.heads), "auto"},
      {"--kv-heads", "N", "KV heads " + auto_note(cpu.kv_heads, gpu.kv_heads), "auto"},
      {"--head-dim", "N",
       "head dim: 64, 80, 96, 128 or 256 " + auto_note(cpu.head_dim, gpu.head_dim), "auto"},
      {"--dtype", "bf16|f16|f32", "activation dtype", "bf16"},
      {"--kv-dtype", "bf16|f16|f32|fp8_e4m3|fp8_e5m2", "KV cache dtype (auto: --dtype)", "auto"},
      {"--window", "N", "sliding window of the even layers in tokens (-1: none)", window},
  };
}

ModelConfig model_from_flags(const Args& args, bool gpu, const ModelDefaults& cpu,
                             const ModelDefaults& gpu_defaults) {
  const ModelDefaults& d = gpu ? gpu_defaults : cpu;
  ModelConfig model;
  model.num_layers = args.get_int("--layers", 1, 256, d.layers);
  model.num_qo_heads = args.get_int("--heads", 1, 256, d.heads);
  model.num_kv_heads = args.get_int("--kv-heads", 1, 256, d.kv_heads);
  model.head_dim = args.get_int("--head-dim", 1, 256, d.head_dim);
  const std::vector<int> dims =
      gpu ? std::vector<int>{64, 128, 256} : std::vector<int>{64, 80, 96, 128, 256};
  if (std::find(dims.begin(), dims.end(), model.head_dim) == dims.end())
    args.fail(str_cat("--head-dim ", model.head_dim, ": expected ",
                      gpu ? "64, 128 or 256 on a GPU" : "64, 80, 96, 128 or 256"));
  if (model.num_qo_heads % model.num_kv_heads != 0)
    args.fail(str_cat("--heads ", model.num_qo_heads, " must be a multiple of --kv-heads ",
                      model.num_kv_heads));
  model.dtype = args.get_dtype("--dtype", {DType::bf16, DType::f16, DType::f32}, DType::bf16);
  model.kv_dtype = args.get_dtype(
      "--kv-dtype", {DType::bf16, DType::f16, DType::f32, DType::fp8_e4m3, DType::fp8_e5m2},
      model.dtype);
  if (!is_fp8(model.kv_dtype) && model.kv_dtype != model.dtype)
    args.fail(str_cat("--kv-dtype ", dtype_name(model.kv_dtype),
                      ": a non-fp8 KV cache has the activation dtype ", dtype_name(model.dtype)));
  model.sliding_window = args.get_int("--window", -1, 1 << 24, -1);
  return model;
}

}  // namespace flashkv::app
