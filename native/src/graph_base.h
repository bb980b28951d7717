// The parts of a decoder graph every architecture shares: inputs, RoPE, the K/V store and attention
// over the stage's cache (as llama.cpp's llm_graph_context has build_inp_*, build_attn). The layers
// themselves are built per architecture: graph_builder.cpp (llama, qwen2), arch_gemma3.cpp (gemma3).
#pragma once

#include "batch_invariance.h"
#include "graph_builder.h"

#include <cmath>

namespace pipeinfer {

// Helpers defined in graph_builder.cpp (see the comments there); mul_mat_rows is batch_invariance.h's.
ggml_tensor * norm_rms(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w, float eps);
ggml_tensor * matmul_bias(ggml_context * ctx, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x, bool invariant);
ggml_tensor * attention(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * mask,
                        float kq_scale, bool invariant);
ggml_tensor * attention_ordered(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * vc,
                                ggml_tensor * mask, ggml_tensor * kq_order, ggml_tensor * v_order, float kq_scale,
                                int64_t n_kv, int64_t d_head, int64_t n_head_kv);
void mark_layer_done(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata);

// One graph under construction. Each builder adds its nodes in the order llama.cpp does.
struct graph_base {
    ggml_context * ctx;
    ggml_cgraph * gf;
    const stage_weights & w;
    const kv_cache & kv;
    const kv_cache * kv_swa;  // sliding-window layers' own cache, or null
    const graph_shape & shape;
    graph_inputs & in;
    const model_hparams & hp;
    const int64_t n_tokens, n_kv, n_head, n_head_kv, d_head, n_embd_gqa, kv_size;
    const float kq_scale;
    const bool inv;         // slice matmuls and attention by rows (shape.invariant, more than one row)
    const bool flash_attn;  // the cache layout follows the attention path
    const bool ordered;     // attention over cells gathered in position order

    graph_base(ggml_context * ctx, ggml_cgraph * gf, const stage_weights & w, const kv_cache & kv,
               const kv_cache * kv_swa, const graph_shape & shape, graph_inputs & in)
        : ctx(ctx), gf(gf), w(w), kv(kv), kv_swa(kv_swa), shape(shape), in(in), hp(w.hparams), n_tokens(shape.n_tokens),
          n_kv(shape.n_kv), n_head(hp.n_head), n_head_kv(hp.n_head_kv), d_head(hp.n_embd_head),
          n_embd_gqa(hp.n_embd_gqa()), kv_size(kv.size()), kq_scale(1.0f / std::sqrt((float) hp.n_embd_head)),
          inv(shape.invariant && shape.n_tokens > 1), flash_attn(!kv.v_trans()),
          ordered(shape.ordered && kv.v_trans()) {}

    ggml_tensor * input(ggml_tensor * t) {
        ggml_set_input(t);
        return t;
    }

    // Input tensors; returns the first layer's input (token embeddings, or the previous stage's states).
    ggml_tensor * build_inputs() {
        ggml_tensor * inpL;
        if (w.is_first()) {
            in.tokens = input(ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens));
            inpL = ggml_get_rows(ctx, w.tok_embd, in.tokens);
        } else {
            in.embd = input(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, hp.n_embd, n_tokens));
            inpL = in.embd;
        }
        in.pos = input(ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens));
        in.kq_mask = input(ggml_new_tensor_2d(ctx, flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32, n_kv, n_tokens));
        if (kv_swa) {  // sliding-window layers in their own cache: gathered views and their mask
            in.kq_mask_swa = input(ggml_new_tensor_2d(ctx, in.kq_mask->type, shape.n_kv_swa, n_tokens));
            in.k_idxs_swa = input(ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens));
            in.swa_rows = input(ggml_new_tensor_2d(ctx, GGML_TYPE_I32, shape.n_kv_swa, shape.swa_groups));
        } else if (hp.n_swa > 0) {  // sliding-window layers (gemma3) have their own mask
            in.kq_mask_swa = input(ggml_new_tensor_2d(ctx, in.kq_mask->type, n_kv, n_tokens));
        }
        in.k_idxs = input(ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens));
        in.v_idxs = input(ggml_new_tensor_1d(ctx, GGML_TYPE_I64, flash_attn ? n_tokens : n_tokens * n_embd_gqa));
        if (ordered) {
            in.kq_order = input(ggml_new_tensor_3d(ctx, GGML_TYPE_I32, n_kv, n_head, n_tokens));
            in.v_order = input(ggml_new_tensor_3d(ctx, GGML_TYPE_I32, n_kv, n_embd_gqa, n_tokens));
        }
        // Like llama.cpp, drop the rows nobody wants before the last layer's FFN and the LM head.
        if (w.is_last() && shape.n_outputs > 0 && shape.n_outputs < n_tokens) {
            in.out_ids = input(ggml_new_tensor_1d(ctx, GGML_TYPE_I32, shape.n_outputs));
        }
        return inpL;
    }

    // RoPE with the model's base and scale, or a layer's own (gemma3's sliding-window layers).
    ggml_tensor * rope(ggml_tensor * x) { return rope(x, hp.rope_freq_base, hp.rope_freq_scale); }
    ggml_tensor * rope(ggml_tensor * x, float freq_base, float freq_scale) {
        return ggml_rope_ext(ctx, x, in.pos, w.rope_freqs, hp.n_rot, hp.rope_type, hp.n_ctx_orig_yarn, freq_base,
                             freq_scale, hp.yarn_ext_factor, hp.yarn_attn_factor, hp.yarn_beta_fast,
                             hp.yarn_beta_slow);
    }

    // Stores K and V of the batch into their cells before attention reads the cache: the graph
    // runs in insertion order, and the cache views of build_attn do not depend on these nodes.
    void build_kv_store(int li, ggml_tensor * K, ggml_tensor * V) {
        if (kv_swa && kv_swa->k(li)) {  // one row per cell for K and V
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, kv_swa->k(li), ggml_reshape_2d(ctx, K, n_embd_gqa, n_tokens), in.k_idxs_swa));
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, kv_swa->v(li), ggml_reshape_2d(ctx, V, n_embd_gqa, n_tokens), in.k_idxs_swa));
            return;
        }
        ggml_tensor * kc = kv.k(li);
        ggml_tensor * vc = kv.v(li);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, kc, ggml_reshape_2d(ctx, K, n_embd_gqa, n_tokens), in.k_idxs));
        if (flash_attn) {
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, vc, ggml_reshape_2d(ctx, V, n_embd_gqa, n_tokens), in.v_idxs));
        } else {
            ggml_tensor * v_flat = ggml_reshape_2d(ctx, V, 1, n_embd_gqa * n_tokens);
            ggml_tensor * vc_flat = ggml_reshape_2d(ctx, vc, 1, ggml_nelements(vc));
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, vc_flat, v_flat, in.v_idxs));
        }
    }

    // Attention of Q over the first n_kv cells of layer li's cache, before the output projection:
    // [d_head*n_head, n_tokens]. A layer may have its own mask (sliding window) and scale.
    ggml_tensor * build_attn(int li, ggml_tensor * Q) { return build_attn(li, Q, in.kq_mask, kq_scale); }
    ggml_tensor * build_attn(int li, ggml_tensor * Q, ggml_tensor * mask, float scale) {
        if (kv_swa && kv_swa->k(li)) return build_attn_window(li, Q, scale);
        ggml_tensor * kc = kv.k(li);
        ggml_tensor * vc = kv.v(li);
        // views of the first n_kv cells: k [d_head, n_head_kv, n_kv]
        const int64_t base = shape.kv_base;  // the batch's KV slot starts here
        ggml_tensor * k = ggml_view_3d(ctx, kc, d_head, n_head_kv, n_kv, ggml_row_size(kc->type, d_head),
                                       ggml_row_size(kc->type, n_embd_gqa), ggml_row_size(kc->type, n_embd_gqa) * base);
        ggml_tensor * q = ggml_permute(ctx, Q, 0, 2, 1, 3);  // [d_head, n_tokens, n_head]
        k = ggml_permute(ctx, k, 0, 2, 1, 3);                 // [d_head, n_kv, n_head_kv]
        ggml_tensor * cur;
        if (flash_attn) {
            ggml_tensor * v = ggml_view_3d(ctx, vc, d_head, n_head_kv, n_kv, ggml_row_size(vc->type, d_head),
                                           ggml_row_size(vc->type, n_embd_gqa), ggml_row_size(vc->type, n_embd_gqa) * base);
            v = ggml_permute(ctx, v, 0, 2, 1, 3);             // [d_head, n_kv, n_head_kv]
            cur = ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0f, 0.0f);  // [d_head, n_head, n_tokens]
            ggml_prec_set_acc(cur, GGML_PREC_F32);
            cur = ggml_reshape_2d(ctx, cur, d_head * n_head, n_tokens);
        } else {
            // v [n_kv, n_head_kv, d_head] -> [n_kv, d_head, n_head_kv]
            ggml_tensor * v = ggml_view_3d(ctx, vc, n_kv, n_head_kv, d_head, ggml_row_size(vc->type, kv_size * d_head),
                                           ggml_row_size(vc->type, kv_size), ggml_row_size(vc->type, base));
            v = ggml_permute(ctx, v, 0, 2, 1, 3);
            ggml_tensor * kqv = ordered ? attention_ordered(ctx, q, k, vc, mask, in.kq_order, in.v_order, scale,
                                                            n_kv, d_head, n_head_kv)
                                        : attention(ctx, q, k, v, mask, scale, inv);  // [d_head, n_tokens, n_head]
            cur = ggml_permute(ctx, kqv, 0, 2, 1, 3);
            cur = ggml_cont_2d(ctx, cur, d_head * n_head, n_tokens);
        }
        ggml_build_forward_expand(gf, cur);
        return cur;
    }

    // Attention of a sliding-window layer over its own cache: per view (the batch, or each token), the
    // window's cells gathered in position order as exact F16 copies, laid out as the full cache's
    // first cells are (see kv_cache::window_rows), so the results are the full cache's bit for bit.
    ggml_tensor * build_attn_window(int li, ggml_tensor * Q, float scale) {
        const int64_t n = shape.n_kv_swa, G = shape.swa_groups, rows = n_tokens / G;
        ggml_tensor * q = ggml_permute(ctx, Q, 0, 2, 1, 3);  // [d_head, n_tokens, n_head]
        ggml_tensor * mask = in.kq_mask_swa;
        ggml_tensor * out = nullptr;
        for (int64_t g = 0; g < G; ++g) {
            ggml_tensor * idx = ggml_view_1d(ctx, in.swa_rows, n, g * in.swa_rows->nb[1]);
            ggml_tensor * kg = ggml_cast(ctx, ggml_get_rows(ctx, kv_swa->k(li), idx), GGML_TYPE_F16);  // [n_embd_gqa, n]
            ggml_tensor * vg = ggml_get_rows(ctx, kv_swa->v(li), idx);
            ggml_tensor * qg = G == 1 ? q : ggml_view_3d(ctx, q, d_head, rows, n_head, q->nb[1], q->nb[2], g * rows * q->nb[1]);
            ggml_tensor * mg = G == 1 ? mask : ggml_view_2d(ctx, mask, n, rows, mask->nb[1], g * rows * mask->nb[1]);
            ggml_tensor * k = ggml_view_3d(ctx, kg, d_head, n_head_kv, n, ggml_row_size(kg->type, d_head),
                                           ggml_row_size(kg->type, n_embd_gqa), 0);
            k = ggml_permute(ctx, k, 0, 2, 1, 3);
            ggml_tensor * cur;
            if (flash_attn) {
                ggml_tensor * v = ggml_view_3d(ctx, ggml_cast(ctx, vg, GGML_TYPE_F16), d_head, n_head_kv, n,
                                               ggml_row_size(kg->type, d_head), ggml_row_size(kg->type, n_embd_gqa), 0);
                cur = ggml_flash_attn_ext(ctx, qg, k, ggml_permute(ctx, v, 0, 2, 1, 3), mg, scale, 0.0f, 0.0f);
                ggml_prec_set_acc(cur, GGML_PREC_F32);  // [d_head, n_head, rows]
                out = out ? ggml_concat(ctx, out, cur, 2) : cur;
            } else {
                ggml_tensor * vt = ggml_cast(ctx, ggml_transpose(ctx, vg), GGML_TYPE_F16);  // [n, n_embd_gqa]
                ggml_tensor * v = ggml_view_3d(ctx, vt, n, n_head_kv, d_head, ggml_row_size(vt->type, n * d_head),
                                               ggml_row_size(vt->type, n), 0);
                cur = attention(ctx, qg, k, ggml_permute(ctx, v, 0, 2, 1, 3), mg, scale, inv);  // [d_head, rows, n_head]
                out = out ? ggml_concat(ctx, out, cur, 1) : cur;
            }
        }
        ggml_tensor * cur = flash_attn ? ggml_reshape_2d(ctx, out, d_head * n_head, n_tokens)
                                       : ggml_cont_2d(ctx, ggml_permute(ctx, out, 0, 2, 1, 3), d_head * n_head, n_tokens);
        ggml_build_forward_expand(gf, cur);
        return cur;
    }

    // Marks layer li finished once cur is computed (layer_progress), and adds cur to the graph.
    ggml_tensor * mark_layer(int li, ggml_tensor * cur, layer_progress & progress) {
        progress.markers[li].value = li + 1;
        cur = ggml_map_custom1_inplace(ctx, cur, mark_layer_done, 1, &progress.markers[li]);
        ggml_build_forward_expand(gf, cur);
        return cur;
    }
};

// Builds the stage's layers on cur with g.build_layer, then g.build_output; null when the batch has
// no rows to output (the layers only store K/V).
template <typename Graph>
ggml_tensor * build_stage(Graph & g, ggml_tensor * cur, layer_progress & progress) {
    const int n_local = (int) g.w.layers.size();
    progress.markers.assign(n_local, layer_marker{&progress.layers_done, 0});
    for (int li = 0; li < n_local; ++li) {
        cur = g.build_layer(li, cur, progress);
        if (!cur) return nullptr;
    }
    return g.build_output(cur);
}

}  // namespace pipeinfer
