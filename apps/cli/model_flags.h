// The model-shape flags `flashkv serve` and `flashkv soak` share (--layers, --heads, --kv-heads,
// --head-dim, --dtype, --kv-dtype, --window), with per-command defaults.
#pragma once

#include <string>
#include <vector>

#include "args.h"
#include "model.h"

namespace flashkv::app {

// What "auto" means for the shape flags, on a CPU and on a GPU.
struct ModelDefaults {
  int layers, heads, kv_heads, head_dim;
};

// The flags' specs; `window` is --window's default (-1: none).
std::vector<FlagSpec> model_flags(const ModelDefaults& cpu, const ModelDefaults& gpu,
                                  const std::string& window);
// The model the flags describe; a bad combination (a head dim without kernels on the device,
// heads not a multiple of KV heads, a non-fp8 KV dtype other than the activations') exits 2.
ModelConfig model_from_flags(const Args& args, bool gpu, const ModelDefaults& cpu,
                             const ModelDefaults& gpu_defaults);

}  // namespace flashkv::app
