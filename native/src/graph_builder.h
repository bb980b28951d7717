// Builds the ggml graph of one eval over a stage's layer range (llama / qwen2 / qwen3 decoder layers).
#pragma once

#include "kv_cache.h"
#include "model_loader.h"

#include <atomic>

namespace pipeinfer {

// Shape of one eval; everything the graph topology depends on.
struct graph_shape {
    int64_t  n_tokens  = 0;  // rows in the batch
    uint32_t n_kv      = 0;  // leading cache cells of the batch's KV slot that attention reads
    uint32_t kv_base   = 0;  // first cell of that slot (0 with one slot)
    int64_t  n_outputs = 0;  // rows returned (last stage: rows with output; else n_tokens)
    bool     invariant = false;  // compute every row exactly as a one-token batch would (see graph_builder.cpp)
    bool     ordered   = false;  // invariant rows read their cells gathered in position order (see kv_cache::position_order)
    uint32_t n_kv_swa   = 0;     // sliding-window cache: cells each view gathers (kv_cache::window_rows)
    int64_t  swa_groups = 0;     // ... and views: 1 (the batch shares one) or n_tokens; 0 without that cache
    bool operator==(const graph_shape & o) const {
        return n_tokens == o.n_tokens && n_kv == o.n_kv && kv_base == o.kv_base && n_outputs == o.n_outputs && invariant == o.invariant &&
               ordered == o.ordered && n_kv_swa == o.n_kv_swa && swa_groups == o.swa_groups;
    }
};

// Input tensors of the graph, filled after allocation.
struct graph_inputs {
    ggml_tensor * tokens  = nullptr;  // I32 [n_tokens]            first stage
    ggml_tensor * embd    = nullptr;  // F32 [n_embd, n_tokens]    later stages
    ggml_tensor * pos     = nullptr;  // I32 [n_tokens]
    ggml_tensor * kq_mask = nullptr;  // F32 [n_kv, n_tokens] (F16 with flash attention)
    ggml_tensor * kq_mask_swa = nullptr;  // the same for sliding-window layers (hparams.n_swa > 0)
    ggml_tensor * k_idxs  = nullptr;  // I64 [n_tokens]            cache row of each token
    ggml_tensor * v_idxs  = nullptr;  // I64 [n_tokens*n_embd_gqa] element index in the transposed V,
                                      //     or I64 [n_tokens] cache row when V is not transposed
    ggml_tensor * out_ids = nullptr;  // I32 [n_outputs]           only when the last stage drops rows
    ggml_tensor * kq_order = nullptr; // I32 [n_kv, n_head, n_tokens]     ordered: cell at each position (per head)
    ggml_tensor * v_order  = nullptr; // I32 [n_kv, n_embd_gqa, n_tokens] ordered: the same, per V channel
    ggml_tensor * k_idxs_swa = nullptr;  // I64 [n_tokens]                 sliding-window cache row of each token
    ggml_tensor * swa_rows   = nullptr;  // I32 [n_kv_swa, swa_groups]     cells each window view gathers
};

// Progress of a running graph: the marker op after each layer stores how many layers finished.
struct layer_marker {
    std::atomic<int> * layers_done;   // counter to update
    int value;                        // layers finished once this marker runs
};
struct layer_progress {
    std::atomic<int> layers_done{0};  // layers of the range finished in the current graph
    std::vector<layer_marker> markers;  // userdata of the marker ops; sized before building
};

// Builds the graph into ctx (a no_alloc context). Returns the output tensor:
// F32 [n_embd, n_tokens] hidden states, or F32 [n_vocab, n_outputs] logits on the last stage.
// kv_swa: the sliding-window layers' own cache (null: they live in kv like the others).
ggml_tensor * graph_build(ggml_context * ctx, ggml_cgraph * gf, const stage_weights & w, const kv_cache & kv,
                          const kv_cache * kv_swa, const graph_shape & shape, graph_inputs & in,
                          layer_progress & progress);

}  // namespace pipeinfer
