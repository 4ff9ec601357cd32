#include "model_presets.h"

#include <algorithm>
#include <sstream>

#include "flashkv/core/error.h"

namespace flashkv::app {

namespace {

// Shorthands for the table below.
ModelPreset dense(std::string name, std::string id, int layers, int heads, int kv_heads,
                  int head_dim, std::string source) {
  ModelPreset p;
  p.name = std::move(name);
  p.model_id = std::move(id);
  p.layers = layers;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.source = std::move(source);
  return p;
}

ModelPreset with_tp(ModelPreset p, int tp) {
  p.name += str_cat("-tp", tp);
  p.tp = tp;
  return p;
}

std::vector<ModelPreset> make_presets() {
  std::vector<ModelPreset> v;
  // Llama 3.1: no head_dim field; head dim = hidden_size / num_attention_heads.
  const std::string llama =
      "num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size / "
      "num_attention_heads";
  const ModelPreset l8 = dense("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 32, 8, 128, llama);
  const ModelPreset l70 = dense("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 64, 8, 128, llama);
  v.push_back(l8);
  v.push_back(with_tp(l8, 8));
  v.push_back(l70);
  v.push_back(with_tp(l70, 8));
  v.push_back(dense("qwen3-8b", "Qwen/Qwen3-8B", 36, 32, 8, 128,
                    "num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim "
                    "(use_sliding_window false)"));
  {
    ModelPreset p = dense("mistral-7b-v0.1", "mistralai/Mistral-7B-v0.1", 32, 32, 8, 128,
                          llama + ", sliding_window (every layer)");
    p.window = 4096;
    v.push_back(p);
  }
  {
    ModelPreset p = dense("gemma-2-9b", "google/gemma-2-9b", 42, 16, 8, 256,
                          "num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, "
                          "sliding_window (even layers), attn_logit_softcapping, "
                          "query_pre_attn_scalar 256");
    p.window = 4096;
    p.full_every = 2;
    p.soft_cap = 50.0f;
    v.push_back(p);
  }
  {
    ModelPreset p =
        dense("gemma-3-12b", "google/gemma-3-12b-pt", 48, 16, 8, 256,
              "text_config: num_hidden_layers, num_attention_heads, num_key_value_heads, "
              "head_dim, sliding_window, sliding_window_pattern 6 (every 6th layer global), "
              "query_pre_attn_scalar 256");
    p.window = 1024;
    p.full_every = 6;
    v.push_back(p);
  }
  {
    ModelPreset p = dense("phi-3-mini", "microsoft/Phi-3-mini-4k-instruct", 32, 32, 32, 96,
                          llama + ", sliding_window (every layer)");
    p.window = 2047;
    v.push_back(p);
  }
  const std::string gpt_oss =
      "num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, sliding_window, "
      "layer_types (sliding, full alternating), self_attn.sinks";
  for (const auto& [name, layers] :
       std::vector<std::pair<std::string, int>>{{"gpt-oss-20b", 24}, {"gpt-oss-120b", 36}}) {
    ModelPreset p = dense(name, "openai/" + name, layers, 64, 8, 64, gpt_oss);
    p.window = 128;
    p.full_every = 2;
    p.sinks = true;
    v.push_back(p);
  }
  {
    ModelPreset p = dense("t5-base", "google-t5/t5-base", 24, 12, 12, 64,
                          "num_decoder_layers 12 (each self + cross attention), num_heads, d_kv");
    p.encoder_decoder = true;
    p.sm_scale = 1.0f;
    p.note =
        "T5 scales no logits (scale 1); its relative position bias is an additive logit term "
        "the kernels do not take, so it is not modelled";
    v.push_back(p);
  }
  return v;
}

std::string join_ints(const std::vector<int>& v, const char* last_sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += i + 1 == v.size() ? last_sep : ", ";
    s += std::to_string(v[i]);
  }
  return s;
}

}  // namespace

ModelConfig ModelPreset::config() const {
  ModelConfig c;
  c.num_layers = layers;
  c.num_qo_heads = tp_heads();
  c.num_kv_heads = tp_kv_heads();
  c.head_dim = head_dim;
  c.sliding_window = window > 0 ? window - 1 : -1;
  c.full_every = full_every;
  c.logit_cap = soft_cap;
  c.sm_scale = sm_scale;
  c.sinks = sinks;
  c.encoder_decoder = encoder_decoder;
  return c;
}

std::string ModelPreset::shape() const {
  std::string s = str_cat(heads, "/", kv_heads, " heads");
  if (tp > 1) s += str_cat(" (", tp_heads(), "/", tp_kv_heads(), " per GPU at tp ", tp, ")");
  s += str_cat(", head dim ", head_dim, ", ", layers, " layers");
  if (window > 0) {
    if (full_every == 0)
      s += str_cat(", window ", window, " on every layer");
    else if (full_every == 2)
      s += str_cat(", window ", window, " on even layers");
    else
      s += str_cat(", window ", window, " on ", full_every - 1, " of ", full_every, " layers");
  }
  if (soft_cap > 0) s += str_cat(", soft cap ", soft_cap);
  if (sm_scale > 0) s += str_cat(", scale ", sm_scale);
  if (sinks) s += ", attention sinks";
  if (encoder_decoder) s += ", cross attention on odd layers";
  return s;
}

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = make_presets();
  return presets;
}

const ModelPreset* find_model_preset(const std::string& name) {
  for (const ModelPreset& p : model_presets())
    if (p.name == name) return &p;
  return nullptr;
}

std::string model_preset_names() {
  std::string s;
  for (const ModelPreset& p : model_presets()) s += (s.empty() ? "" : ", ") + p.name;
  return s;
}

std::string model_preset_table() {
  std::ostringstream os;
  os << "Model presets (--model NAME; shape flags given with it override its fields). Each is "
        "taken from\nthe model's Hugging Face config.json; a window of W tokens gives layers "
        "sliding_window_size W - 1.\n\n";
  for (const ModelPreset& p : model_presets()) {
    os << "  " << p.name << "\n";
    os << "      " << p.shape() << "\n";
    os << "      source: " << p.model_id << " config.json: " << p.source << "\n";
    if (!p.note.empty()) os << "      note: " << p.note << "\n";
  }
  return os.str();
}

std::vector<int> supported_head_dims(bool cuda) {
  return cuda ? std::vector<int>{64, 128, 256} : std::vector<int>{64, 80, 96, 128, 256};
}

std::string model_unsupported_reason(const ModelConfig& model, bool cuda) {
  const std::vector<int> dims = supported_head_dims(cuda);
  if (std::find(dims.begin(), dims.end(), model.head_dim) == dims.end())
    return str_cat("head dim ", model.head_dim, ": the ", cuda ? "CUDA" : "CPU",
                   " kernels support ", join_ints(dims, " and "),
                   cuda ? " (the CPU ones also 80 and 96)" : "");
  return "";
}

}  // namespace flashkv::app
