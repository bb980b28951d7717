#include "graph_builder.h"

#include "arch_gemma3.h"
#include "batch_invariance.h"
#include "ffn_moe.h"
#include "graph_base.h"
#include "ggml-backend.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

namespace pipeinfer {

// Runs after a layer's last op; lets the engine count the layers that finished when a cancel
// aborts the graph midway (the abort callback alone cannot tell which node it stopped at).
void mark_layer_done(ggml_tensor * /*dst*/, const ggml_tensor * /*a*/, int ith, int /*nth*/, void * userdata) {
    if (ith != 0) return;
    const auto * m = (const layer_marker *) userdata;
    m->layers_done->store(m->value, std::memory_order_relaxed);
}

ggml_tensor * norm_rms(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), w);
}

ggml_tensor * matmul_bias(ggml_context * ctx, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x, bool invariant) {
    ggml_tensor * y = mul_mat_rows(ctx, w, x, invariant);
    return b ? ggml_add(ctx, y, b) : y;
}

// Attention without flash attention: q [d_head, n_tokens, n_head], k [d_head, n_kv, n_head_kv],
// v [n_kv, d_head, n_head_kv] -> [d_head, n_tokens, n_head]. With invariant, one query row at a
// time, so each row is computed exactly as in a one-token batch.
ggml_tensor * attention(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * mask,
                        float kq_scale, bool invariant) {
    const int64_t n_tokens = q->ne[1];
    const int64_t step = invariant ? 1 : n_tokens;
    ggml_tensor * out = nullptr;
    for (int64_t t = 0; t < n_tokens; t += step) {
        const int64_t rows = std::min(step, n_tokens - t);
        ggml_tensor * qt = step == n_tokens ? q : ggml_view_3d(ctx, q, q->ne[0], rows, q->ne[2], q->nb[1], q->nb[2], t * q->nb[1]);
        ggml_tensor * mt = step == n_tokens ? mask : ggml_view_2d(ctx, mask, mask->ne[0], rows, mask->nb[1], t * mask->nb[1]);
        ggml_tensor * kq = ggml_mul_mat(ctx, k, qt);          // [n_kv, rows, n_head]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(ctx, kq, mt, kq_scale, 0.0f);
        ggml_tensor * kqv = ggml_mul_mat(ctx, v, kq);        // [d_head, rows, n_head]
        out = out ? ggml_concat(ctx, out, kqv, 1) : kqv;
    }
    return out;
}

// Attention with the cells gathered in position order, one query row at a time (shape.ordered).
// In a token tree several branches hold cells at the same positions, so a branch's cells cannot all
// sit at cell index == position as in plain decoding. The sums of the softmax and of the V product
// run over cells in index order (in SIMD lanes), so the same visible cells at other indices round
// differently. Gathering each row's scores and V rows by position gives the very operands plain
// decoding has (masked positions contribute exact zeros), hence bit-identical results.
ggml_tensor * attention_ordered(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * vc,
                                ggml_tensor * mask, ggml_tensor * kq_order, ggml_tensor * v_order, float kq_scale,
                                int64_t n_kv, int64_t d_head, int64_t n_head_kv) {
    const int64_t n_tokens = q->ne[1], n_head = q->ne[2];
    const int64_t n_embd_gqa = d_head * n_head_kv;
    ggml_tensor * v_src = ggml_reshape_3d(ctx, vc, 1, vc->ne[0], n_embd_gqa);  // transposed V: [1, kv_size, channels]
    ggml_tensor * out = nullptr;
    for (int64_t t = 0; t < n_tokens; ++t) {
        ggml_tensor * qt = ggml_view_3d(ctx, q, q->ne[0], 1, n_head, q->nb[1], q->nb[2], t * q->nb[1]);
        ggml_tensor * mt = ggml_view_2d(ctx, mask, mask->ne[0], 1, mask->nb[1], t * mask->nb[1]);
        ggml_tensor * kq = ggml_mul_mat(ctx, k, qt);  // [n_kv, 1, n_head], cells in index order
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        ggml_tensor * ko = ggml_view_2d(ctx, kq_order, n_kv, n_head, kq_order->nb[1], t * kq_order->nb[2]);
        kq = ggml_get_rows(ctx, ggml_reshape_3d(ctx, kq, 1, n_kv, n_head), ko);  // [1, n_kv, n_head] by position
        kq = ggml_reshape_3d(ctx, kq, n_kv, 1, n_head);
        kq = ggml_soft_max_ext(ctx, kq, mt, kq_scale, 0.0f);
        ggml_tensor * vo = ggml_view_2d(ctx, v_order, n_kv, n_embd_gqa, v_order->nb[1], t * v_order->nb[2]);
        ggml_tensor * v = ggml_get_rows(ctx, v_src, vo);  // [1, n_kv, channels] F32, exact copies of F16 values
        v = ggml_reshape_3d(ctx, ggml_cast(ctx, v, GGML_TYPE_F16), n_kv, d_head, n_head_kv);
        ggml_tensor * kqv = ggml_mul_mat(ctx, v, kq);  // [d_head, 1, n_head]
        out = out ? ggml_concat(ctx, out, kqv, 1) : kqv;
    }
    return out;
}

namespace {

// The llama/qwen2 decoder layers on the shared parts of graph_base.
struct graph_context : graph_base {
    using graph_base::graph_base;

    void build_qkv(const layer_weights & L, ggml_tensor * x, ggml_tensor *& Q, ggml_tensor *& K, ggml_tensor *& V) {
        ggml_tensor * cur = norm_rms(ctx, x, L.attn_norm, hp.f_norm_rms_eps);
        Q = matmul_bias(ctx, L.wq, L.bq, cur, inv);
        K = matmul_bias(ctx, L.wk, L.bk, cur, inv);
        V = matmul_bias(ctx, L.wv, L.bv, cur, inv);
        Q = ggml_reshape_3d(ctx, Q, d_head, n_head, n_tokens);
        K = ggml_reshape_3d(ctx, K, d_head, n_head_kv, n_tokens);
        V = ggml_reshape_3d(ctx, V, d_head, n_head_kv, n_tokens);
        if (L.attn_q_norm) Q = norm_rms(ctx, Q, L.attn_q_norm, hp.f_norm_rms_eps);  // per head (qwen3)
        Q = rope(Q);
        if (L.attn_k_norm) K = norm_rms(ctx, K, L.attn_k_norm, hp.f_norm_rms_eps);
        K = rope(K);
        ggml_build_forward_expand(gf, Q);
        ggml_build_forward_expand(gf, V);
        ggml_build_forward_expand(gf, K);
    }

    // SwiGLU feed-forward with its residual: x + down(silu(gate(norm x)) * up(norm x)); a
    // mixture-of-experts layer routes each row to its experts instead (ffn_moe.cpp).
    ggml_tensor * build_ffn(const layer_weights & L, ggml_tensor * ffn_inp) {
        ggml_tensor * cur = norm_rms(ctx, ffn_inp, L.ffn_norm, hp.f_norm_rms_eps);
        if (L.ffn_gate_inp) return ggml_add(ctx, build_moe_ffn(ctx, gf, cur, L, hp, inv), ffn_inp);
        ggml_tensor * up   = mul_mat_rows(ctx, L.ffn_up, cur, inv);
        ggml_tensor * gate = mul_mat_rows(ctx, L.ffn_gate, cur, inv);
        cur = ggml_swiglu_split(ctx, gate, up);
        cur = mul_mat_rows(ctx, L.ffn_down, cur, inv);
        return ggml_add(ctx, cur, ffn_inp);
    }

    // One decoder layer (local index li). Returns null when the model's last layer has no rows to
    // output: its K/V stores are then all it has to do (as llama.cpp does for a batch without outputs).
    ggml_tensor * build_layer(int li, ggml_tensor * inpL, layer_progress & progress) {
        const layer_weights & L = w.layers[li];
        const bool model_last_layer = w.layer_begin + li == (int) hp.n_layer - 1;
        ggml_tensor *Q, *K, *V;
        build_qkv(L, inpL, Q, K, V);
        build_kv_store(li, K, V);
        if (model_last_layer && w.is_last() && shape.n_outputs == 0) return nullptr;

        ggml_tensor * cur = matmul_bias(ctx, L.wo, L.bo, build_attn(li, Q), inv);
        ggml_tensor * inpSA = inpL;
        if (model_last_layer && in.out_ids) {
            cur   = ggml_get_rows(ctx, cur, in.out_ids);
            inpSA = ggml_get_rows(ctx, inpSA, in.out_ids);
        }
        cur = build_ffn(L, ggml_add(ctx, cur, inpSA));
        return mark_layer(li, cur, progress);
    }

    // Output norm and LM head on the last stage; the hidden states elsewhere.
    ggml_tensor * build_output(ggml_tensor * out) {
        if (w.is_last()) {
            out = norm_rms(ctx, out, w.output_norm, hp.f_norm_rms_eps);
            out = matmul_bias(ctx, w.output, w.output_b, out, shape.invariant && out->ne[1] > 1);
        }
        ggml_set_output(out);
        ggml_build_forward_expand(gf, out);
        return out;
    }
};

}  // namespace

ggml_tensor * graph_build(ggml_context * ctx, ggml_cgraph * gf, const stage_weights & w, const kv_cache & kv,
                          const kv_cache * kv_swa, const graph_shape & shape, graph_inputs & in,
                          layer_progress & progress) {
    if (w.hparams.arch == "gemma3") return gemma3_graph_build(ctx, gf, w, kv, kv_swa, shape, in, progress);
    graph_context g(ctx, gf, w, kv, kv_swa, shape, in);
    return build_stage(g, g.build_inputs(), progress);
}

}  // namespace pipeinfer
