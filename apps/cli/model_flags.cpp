#include "model_flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "workload.h"

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
      {"--model", "NAME|list",
       "a published model's attention shape (list: the presets and their sources); the shape "
       "flags given with it override its fields",
       ""},
      {"--layers", "N", "attention layers " + auto_note(cpu.layers, gpu.layers), "auto"},
      {"--heads", "N", "query heads " + auto_note(cpu.heads, gpu.heads), "auto"},
      {"--kv-heads", "N", "KV heads " + auto_note(cpu.kv_heads, gpu.kv_heads), "auto"},
      {"--head-dim", "N",
       "head dim: 64, 80, 96, 128 or 256 (CUDA: 64, 128 or 256) " +
           auto_note(cpu.head_dim, gpu.head_dim),
       "auto"},
      {"--dtype", "bf16|f16|f32", "activation dtype", "bf16"},
      {"--kv-dtype", "bf16|f16|f32|fp8_e4m3|fp8_e5m2", "KV cache dtype (auto: --dtype)", "auto"},
      {"--window", "N",
       "sliding window in tokens of the windowed layers, a query at p seeing keys p - N .. p "
       "(-1: none)",
       window},
      {"--full-every", "N",
       "with --window: every N-th layer attends fully, the others within the window (0: every "
       "layer windowed; 2: even layers windowed)",
       "2"},
      {"--soft-cap", "X", "logit soft cap of every layer (0: none)", "0"},
      {"--encoder-len", "N",
       "encoder-decoder models: each request's encoder input has N/2 .. N tokens " +
           auto_note(cpu.encoder_len, gpu.encoder_len),
       "auto"},
  };
}

int32_t encoder_len_from_flags(const Args& args, const ModelConfig& model, bool gpu,
                               const ModelDefaults& cpu, const ModelDefaults& gpu_defaults) {
  if (!model.encoder_decoder) {
    if (args.given("--encoder-len"))
      args.fail(
          "--encoder-len: the model has no cross attention (an encoder-decoder model such "
          "as --model t5-base has)");
    return 0;
  }
  return args.get_int("--encoder-len", 1, kMaxEncoderTokens,
                      (gpu ? gpu_defaults : cpu).encoder_len);
}

const ModelPreset* preset_from_flags(const Args& args) {
  const std::string& name = args.get("--model");
  if (name.empty()) return nullptr;
  if (name == "list") {
    std::fputs(model_preset_table().c_str(), stdout);
    std::exit(0);
  }
  const ModelPreset* p = find_model_preset(name);
  if (!p)
    args.fail(str_cat("--model ", name, ": unknown model; expected list or one of ",
                      model_preset_names()));
  return p;
}

ModelConfig model_from_flags(const Args& args, bool gpu, const ModelDefaults& cpu,
                             const ModelDefaults& gpu_defaults) {
  const ModelDefaults& d = gpu ? gpu_defaults : cpu;
  const ModelPreset* preset = preset_from_flags(args);
  ModelConfig model;
  if (preset) {
    model = preset->config();
  } else {
    model.num_layers = d.layers;
    model.num_qo_heads = d.heads;
    model.num_kv_heads = d.kv_heads;
    model.head_dim = d.head_dim;
    model.sliding_window = args.get_int("--window", -1, 1 << 24, -1);
  }
  // Without a preset every flag applies (its default included); with one, the given ones.
  const auto use = [&](const char* flag) { return !preset || args.given(flag); };
  if (use("--layers")) model.num_layers = args.get_int("--layers", 1, 256, model.num_layers);
  if (use("--heads")) model.num_qo_heads = args.get_int("--heads", 1, 256, model.num_qo_heads);
  if (use("--kv-heads"))
    model.num_kv_heads = args.get_int("--kv-heads", 1, 256, model.num_kv_heads);
  if (use("--head-dim")) model.head_dim = args.get_int("--head-dim", 1, 256, model.head_dim);
  if (use("--window")) model.sliding_window = args.get_int("--window", -1, 1 << 24, -1);
  if (use("--full-every")) model.full_every = args.get_int("--full-every", 0, 1 << 16, 2);
  if (use("--soft-cap"))
    model.logit_cap = static_cast<float>(args.get_double("--soft-cap", 0, 1e6));
  const std::string what = preset ? str_cat("--model ", preset->name, ": ") : std::string();
  const std::string reason = model_unsupported_reason(model, gpu);
  if (!reason.empty()) args.fail(what + reason);
  if (model.encoder_decoder && model.sliding_window >= 0)
    args.fail(str_cat(what, "--window ", model.sliding_window,
                      ": a model with cross attention has no sliding-window layers"));
  if (model.num_qo_heads % model.num_kv_heads != 0)
    args.fail(str_cat(what, "--heads ", model.num_qo_heads, " must be a multiple of --kv-heads ",
                      model.num_kv_heads));
  model.dtype = args.get_dtype("--dtype", {DType::bf16, DType::f16, DType::f32}, DType::bf16);
  model.kv_dtype = args.get_dtype(
      "--kv-dtype", {DType::bf16, DType::f16, DType::f32, DType::fp8_e4m3, DType::fp8_e5m2},
      model.dtype);
  if (!is_fp8(model.kv_dtype) && model.kv_dtype != model.dtype)
    args.fail(str_cat("--kv-dtype ", dtype_name(model.kv_dtype),
                      ": a non-fp8 KV cache has the activation dtype ", dtype_name(model.dtype)));
  return model;
}

}  // namespace flashkv::app
