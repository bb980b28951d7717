// Gemma 3 (general.architecture "gemma3"): its hyperparameters and its decoder graph.
//
// What differs from llama/qwen2 (llama.cpp: src/models/gemma3.cpp, llm_build_gemma3_iswa):
//   - token embeddings scaled by sqrt(n_embd); the LM head is tied to token_embd;
//   - RMS norms before and after attention and the FFN (attn_norm / post_attention_norm,
//     ffn_norm / post_ffw_norm), GELU-gated FFN;
//   - per-head RMS norms of Q and K before RoPE, queries scaled by 1/sqrt(head size) before attention;
//   - sliding-window attention on the local layers (all but every 6th by default), which have their
//     own RoPE base (rope.freq_base_swa, default 10000); a token at position p attends the cells at
//     positions (p - n_swa, p] of its sequence there. Those layers keep their own cache of about
//     n_swa + 512 cells (the engine's sliding-window cache), unless PIPEINFER_SWA_FULL=1.
//   - optional final logit softcapping.
#pragma once

#include "ggml.h"
#include "graph_builder.h"
#include "model_loader.h"

namespace pipeinfer {

class gguf_file;

// Reads the gemma3-only hyperparameters into hp (sizes and RoPE are already read).
void gemma3_read_hparams(const gguf_file & f, model_hparams & hp);

// graph_build for a gemma3 stage.
ggml_tensor * gemma3_graph_build(ggml_context * ctx, ggml_cgraph * gf, const stage_weights & w, const kv_cache & kv,
                                 const kv_cache * kv_swa, const graph_shape & shape, graph_inputs & in, layer_progress & progress);

}  // namespace pipeinfer
