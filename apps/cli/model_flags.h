// The model flags `flashkv serve` and `flashkv soak` share (--model, --layers, --heads,
// --kv-heads, --head-dim, --dtype, --kv-dtype, --window, --full-every, --soft-cap,
// --encoder-len), with per-command defaults.
#pragma once

#include <string>
#include <vector>

#include "args.h"
#include "model.h"
#include "model_presets.h"

namespace flashkv::app {

// What "auto" means for the shape flags, on a CPU and on a GPU.
struct ModelDefaults {
  int layers, heads, kv_heads, head_dim;
  int encoder_len;  // longest encoder input of a request (encoder-decoder models)
};

// The flags' specs; `window` is --window's default (-1: none).
std::vector<FlagSpec> model_flags(const ModelDefaults& cpu, const ModelDefaults& gpu,
                                  const std::string& window);
// The model the flags describe: --model's preset (when given), then every shape flag given on
// the command line over it. `--model list` prints the presets and exits 0; an unknown model, or
// a bad combination (a head dim without kernels on the device, cross attention with a sliding
// window, heads not a multiple of KV heads, a non-fp8 KV dtype other than the activations')
// exits 2 with one line. Attention sinks are not one: they run on the CPU and on CUDA.
ModelConfig model_from_flags(const Args& args, bool gpu, const ModelDefaults& cpu,
                             const ModelDefaults& gpu_defaults);
// --encoder-len for `model`: the longest encoder input of a request (each request draws
// (N + 1) / 2 .. N tokens, draw_encoder_lens), its default when not given; 0 for a model without
// cross attention, for which giving the flag exits 2.
int32_t encoder_len_from_flags(const Args& args, const ModelConfig& model, bool gpu,
                               const ModelDefaults& cpu, const ModelDefaults& gpu_defaults);
// The preset --model names (nullptr when none); `--model list` prints the table and exits 0,
// an unknown name exits 2 listing the names.
const ModelPreset* preset_from_flags(const Args& args);

}  // namespace flashkv::app
