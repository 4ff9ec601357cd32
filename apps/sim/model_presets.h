// Model presets: the attention shapes of published models (heads, KV heads, head dim, layers,
// which layers use a sliding window, logit soft cap, attention sinks, cross attention), each
// taken from the model's Hugging Face config.json and naming the fields it comes from. `flashkv
// serve|soak|bench --model NAME` start from one; explicit shape flags override its fields.
#pragma once

#include <string>
#include <vector>

#include "model.h"

namespace flashkv::app {

struct ModelPreset {
  std::string name;      // "llama-3.1-8b", "llama-3.1-70b-tp8", ...
  std::string model_id;  // the Hugging Face model id the numbers come from
  int layers = 0;        // attention layers the model runs per token (num_hidden_layers, ...)
  int heads = 0, kv_heads = 0, head_dim = 0;  // of the whole model (before tensor parallelism)
  int tp = 1;  // tensor-parallel degree: each GPU holds heads / tp and kv_heads / tp (at least 1)
  // The config's sliding_window: a query sees this many keys, itself included (0: no window).
  // Layers get sliding_window_size = window - 1, SGLang's count (keys p - w .. p).
  int window = 0;
  int full_every = 0;            // with a window: 0 every layer windowed, N every N-th layer full
  float soft_cap = 0;            // attn_logit_softcapping (0: none)
  float sm_scale = 0;            // 0: 1 / sqrt(head_dim)
  bool sinks = false;            // learned per-head sink logits
  bool encoder_decoder = false;  // decoder blocks of self + cross attention (layers alternate)
  std::string source;            // the config.json fields the numbers are taken from
  std::string note;              // what the preset leaves out or how a field maps, if anything

  // The simulator's model for this preset (per-GPU heads).
  ModelConfig config() const;
  int tp_heads() const { return heads / tp; }
  int tp_kv_heads() const { return kv_heads >= tp ? kv_heads / tp : 1; }
  // e.g. "32/8 heads, head dim 128, window 4096 on every layer, soft cap 50"
  std::string shape() const;
};

const std::vector<ModelPreset>& model_presets();
// The preset called `name`, or nullptr.
const ModelPreset* find_model_preset(const std::string& name);
// "llama-3.1-8b, llama-3.1-8b-tp8, ..." for error messages.
std::string model_preset_names();
// The table `--model list` prints: every preset's shape and its source.
std::string model_preset_table();

// Head dims the attention kernels of a device kind support (CPU: 64, 80, 96, 128, 256; CUDA:
// 64, 128, 256), and a model's features the serving path cannot run there: an empty string when
// it can run, else one line naming what is missing (e.g. "head dim 96: the CUDA kernels support
// 64, 128 and 256") so that a run fails before it starts.
std::vector<int> supported_head_dims(bool cuda);
std::string model_unsupported_reason(const ModelConfig& model, bool cuda);

}  // namespace flashkv::app
