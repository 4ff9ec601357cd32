// Model presets: each preset's numbers as its published config states them, the per-layer
// window pattern, tensor parallelism, and the check that refuses a model a device cannot run.
#include <gtest/gtest.h>

#include <set>

#include "model_presets.h"

namespace flashkv::app {
namespace {

const ModelPreset& preset(const std::string& name) {
  const ModelPreset* p = find_model_preset(name);
  EXPECT_NE(p, nullptr) << name;
  static const ModelPreset none;
  return p ? *p : none;
}

TEST(ModelPresets, NamesAreUniqueAndEachStatesItsSource) {
  std::set<std::string> names;
  for (const ModelPreset& p : model_presets()) {
    EXPECT_TRUE(names.insert(p.name).second) << p.name;
    EXPECT_FALSE(p.model_id.empty()) << p.name;
    EXPECT_NE(p.source.find("num_"), std::string::npos) << p.name;
    EXPECT_EQ(p.heads % p.kv_heads, 0) << p.name;
  }
  for (const char* name :
       {"llama-3.1-8b", "llama-3.1-70b", "llama-3.1-70b-tp8", "qwen3-8b", "mistral-7b-v0.1",
        "gemma-2-9b", "gemma-3-12b", "phi-3-mini", "gpt-oss-20b", "gpt-oss-120b", "t5-base"})
    EXPECT_TRUE(names.count(name)) << name;
  EXPECT_EQ(find_model_preset("llama-9"), nullptr);
}

TEST(ModelPresets, ShapesMatchThePublishedConfigs) {
  struct Want {
    const char* name;
    int layers, heads, kv_heads, head_dim, window_size;  // window_size: the layers' (-1: none)
  };
  for (const Want& w : std::vector<Want>{{"llama-3.1-8b", 32, 32, 8, 128, -1},
                                         {"llama-3.1-70b", 80, 64, 8, 128, -1},
                                         {"llama-3.1-70b-tp8", 80, 8, 1, 128, -1},
                                         {"qwen3-8b", 36, 32, 8, 128, -1},
                                         {"mistral-7b-v0.1", 32, 32, 8, 128, 4095},
                                         {"gemma-2-9b", 42, 16, 8, 256, 4095},
                                         {"gemma-3-12b", 48, 16, 8, 256, 1023},
                                         {"phi-3-mini", 32, 32, 32, 96, 2046},
                                         {"gpt-oss-20b", 24, 64, 8, 64, 127},
                                         {"gpt-oss-120b", 36, 64, 8, 64, 127}}) {
    const ModelConfig c = preset(w.name).config();
    EXPECT_EQ(c.num_layers, w.layers) << w.name;
    EXPECT_EQ(c.num_qo_heads, w.heads) << w.name;
    EXPECT_EQ(c.num_kv_heads, w.kv_heads) << w.name;
    EXPECT_EQ(c.head_dim, w.head_dim) << w.name;
    EXPECT_EQ(c.sliding_window, w.window_size) << w.name;
  }
  EXPECT_EQ(preset("gemma-2-9b").config().logit_cap, 50.0f);
  EXPECT_EQ(preset("gemma-3-12b").config().logit_cap, 0.0f);
  EXPECT_TRUE(preset("gpt-oss-20b").config().sinks);
  EXPECT_FALSE(preset("llama-3.1-8b").config().sinks);
  const ModelConfig t5 = preset("t5-base").config();
  EXPECT_TRUE(t5.encoder_decoder);
  EXPECT_TRUE(t5.layer(1).is_cross_attention);
  EXPECT_FALSE(t5.layer(0).is_cross_attention);
  EXPECT_EQ(t5.layer(0).scaling, 1.0f);
}

// Which layers get the window: every layer (Mistral), even layers (Gemma 2, gpt-oss), five of
// six with every sixth full (Gemma 3).
TEST(ModelPresets, WindowLayerPatterns) {
  const auto windowed = [](const ModelConfig& c, int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += c.layer(i).sliding_window_size >= 0 ? 'w' : 'f';
    return s;
  };
  EXPECT_EQ(windowed(preset("mistral-7b-v0.1").config(), 6), "wwwwww");
  EXPECT_EQ(windowed(preset("gemma-2-9b").config(), 6), "wfwfwf");
  EXPECT_EQ(windowed(preset("gpt-oss-20b").config(), 6), "wfwfwf");
  EXPECT_EQ(windowed(preset("gemma-3-12b").config(), 12), "wwwwwfwwwwwf");
  EXPECT_EQ(windowed(preset("qwen3-8b").config(), 4), "ffff");
  EXPECT_EQ(preset("gemma-2-9b").config().layer(0).logit_cap, 50.0f);
  // The simulator's default (no preset) keeps windows on even layers.
  ModelConfig plain;
  plain.sliding_window = 16;
  EXPECT_EQ(windowed(plain, 4), "wfwf");
  EXPECT_NE(preset("gemma-3-12b").config().str().find("window 1023 on 5 of 6 layers"),
            std::string::npos);
}

TEST(ModelPresets, TensorParallelismDividesTheHeads) {
  const ModelPreset& p = preset("llama-3.1-8b-tp8");
  EXPECT_EQ(p.tp, 8);
  EXPECT_EQ(p.config().num_qo_heads, 4);
  EXPECT_EQ(p.config().num_kv_heads, 1);
  EXPECT_NE(p.shape().find("4/1 per GPU at tp 8"), std::string::npos) << p.shape();
}

TEST(ModelPresets, UnsupportedOnADeviceNamesTheHeadDimAndTheDevice) {
  const ModelConfig phi = preset("phi-3-mini").config();
  EXPECT_EQ(model_unsupported_reason(phi, /*cuda=*/false), "");
  const std::string cuda = model_unsupported_reason(phi, /*cuda=*/true);
  EXPECT_NE(cuda.find("head dim 96"), std::string::npos) << cuda;
  EXPECT_NE(cuda.find("CUDA"), std::string::npos) << cuda;
  for (const char* ok : {"llama-3.1-8b", "gemma-2-9b", "gemma-3-12b", "qwen3-8b"}) {
    EXPECT_EQ(model_unsupported_reason(preset(ok).config(), true), "") << ok;
    EXPECT_EQ(model_unsupported_reason(preset(ok).config(), false), "") << ok;
  }
  ModelConfig odd;
  odd.head_dim = 72;
  EXPECT_NE(model_unsupported_reason(odd, false).find("head dim 72: the CPU kernels"),
            std::string::npos);
  // Sinks run on both devices.
  for (bool cuda : {false, true})
    EXPECT_EQ(model_unsupported_reason(preset("gpt-oss-20b").config(), cuda), "") << cuda;
}

}  // namespace
}  // namespace flashkv::app
