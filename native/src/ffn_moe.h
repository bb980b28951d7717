// The mixture-of-experts feed-forward of one layer (qwen3moe, llama files with experts).
#pragma once

#include "model_loader.h"

#include "ggml.h"

namespace pipeinfer {

// cur: the FFN-normed hidden states [n_embd, n_tokens]. Routes every row to its top n_expert_used
// experts and returns their weighted sum [n_embd, n_tokens] (the caller adds the residual). With
// invariant, each row is computed exactly as in a one-token batch (batch_invariance.h).
ggml_tensor * build_moe_ffn(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * cur, const layer_weights & L,
                            const model_hparams & hp, bool invariant);

}  // namespace pipeinfer
