// The op sequence is llama.cpp's build_moe_ffn for softmax gating with normalised weights, the path
// its llama and qwen3moe graphs take, so that the results round the same way:
//   probs = softmax(router · x); experts = top-k(probs) (argsort); w = probs[experts] / Σ w;
//   y = Σ_k w_k · down_k(silu(gate_k x) · up_k x)   (experts via MUL_MAT_ID, summed in slot order).
// Every op after the router works row by row (softmax, argsort, get_rows, sum_rows, div, mul, add),
// and mul_mat_id_rows keeps the expert matmuls row-independent, so the routing and the output of
// a row never depend on the other rows of the batch.
#include "ffn_moe.h"

#include "batch_invariance.h"

#include <cmath>

namespace pipeinfer {

namespace {

// Router: the top n_used experts of each row and their weights [1, n_used, n_tokens], normalised
// to sum to 1 (clamped like llama.cpp, against a division by zero).
ggml_tensor * route(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * cur, const layer_weights & L,
                    const model_hparams & hp, bool invariant, ggml_tensor *& selected) {
    const int64_t n_expert = hp.n_expert, n_used = hp.n_expert_used, n_tokens = cur->ne[1];
    ggml_tensor * logits = mul_mat_rows(ctx, L.ffn_gate_inp, cur, invariant);  // [n_expert, n_tokens]
    ggml_tensor * probs = ggml_soft_max(ctx, logits);
    selected = ggml_argsort_top_k(ctx, probs, (int) n_used);                   // I32 [n_used, n_tokens]
    ggml_tensor * weights = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, n_expert, n_tokens), selected);
    weights = ggml_reshape_2d(ctx, weights, n_used, n_tokens);
    ggml_tensor * sum = ggml_clamp(ctx, ggml_sum_rows(ctx, weights), 6.103515625e-5f, INFINITY);
    weights = ggml_reshape_3d(ctx, ggml_div(ctx, weights, sum), 1, n_used, n_tokens);
    ggml_build_forward_expand(gf, weights);
    return weights;
}

}  // namespace

ggml_tensor * build_moe_ffn(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * cur, const layer_weights & L,
                            const model_hparams & hp, bool invariant) {
    const int64_t n_embd = cur->ne[0], n_tokens = cur->ne[1], n_used = hp.n_expert_used;
    ggml_tensor * selected = nullptr;
    ggml_tensor * weights = route(ctx, gf, cur, L, hp, invariant, selected);

    cur = ggml_reshape_3d(ctx, cur, n_embd, 1, n_tokens);
    ggml_tensor * up = mul_mat_id_rows(ctx, L.ffn_up_exps, cur, selected, invariant);  // [n_ff_exp, n_used, n_tokens]
    ggml_tensor * act;
    if (L.ffn_gate_exps) {
        ggml_tensor * gate = mul_mat_id_rows(ctx, L.ffn_gate_exps, cur, selected, invariant);
        act = ggml_swiglu_split(ctx, gate, up);
    } else {
        act = ggml_silu(ctx, up);  // a llama MoE without gate experts, as llama.cpp computes it
    }
    ggml_tensor * experts = mul_mat_id_rows(ctx, L.ffn_down_exps, act, selected, invariant);  // [n_embd, n_used, n_tokens]
    experts = ggml_mul(ctx, experts, weights);
    ggml_build_forward_expand(gf, experts);

    // Sum the experts' slots in order, as views of one tensor (llama.cpp's order of the adds).
    ggml_tensor * out = nullptr;
    for (int64_t i = 0; i < n_used; ++i) {
        ggml_tensor * slot = ggml_view_2d(ctx, experts, n_embd, n_tokens, experts->nb[2], i * experts->nb[1]);
        ggml_build_forward_expand(gf, slot);
        out = out ? ggml_add(ctx, out, slot) : slot;
        if (i > 0) ggml_build_forward_expand(gf, out);
    }
    return n_used == 1 ? ggml_cont(ctx, out) : out;
}

}  // namespace pipeinfer
