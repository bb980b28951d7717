#include "arch_gemma3.h"

#include "errors.h"
#include "gguf_file.h"
#include "graph_base.h"

#include <cmath>
#include <string>

namespace pipeinfer {

namespace {

// attention.sliding_window_pattern: a per-layer array (true = local), or a period n where every
// n-th layer is global (llama.cpp's default for gemma3 is 6); 0 makes every layer local.
void read_swa_pattern(const gguf_file & f, const std::string & key, model_hparams & hp) {
    hp.swa_layers.assign(hp.n_layer, 0);
    const int64_t id = gguf_find_key(f.ctx(), key.c_str());
    if (id >= 0 && gguf_get_kv_type(f.ctx(), id) == GGUF_TYPE_ARRAY) {
        const gguf_type t = gguf_get_arr_type(f.ctx(), id);
        if (gguf_get_arr_n(f.ctx(), id) != hp.n_layer || (t != GGUF_TYPE_BOOL && t != GGUF_TYPE_INT8 && t != GGUF_TYPE_UINT8)) {
            throw model_file_error(f.path() + ": metadata key '" + key + "' must be one boolean per layer (" +
                                   std::to_string(hp.n_layer) + ")");
        }
        const auto * v = (const uint8_t *) gguf_get_arr_data(f.ctx(), id);
        for (uint32_t il = 0; il < hp.n_layer; ++il) hp.swa_layers[il] = v[il] != 0;
        return;
    }
    const uint32_t period = (uint32_t) f.get_uint(key, 6, false);
    for (uint32_t il = 0; il < hp.n_layer; ++il) hp.swa_layers[il] = period == 0 || il % period < period - 1;
}

// The decoder layers of gemma3 on the shared parts of graph_base, op for op as llama.cpp builds them.
struct gemma3_graph : graph_base {
    using graph_base::graph_base;

    // Token embeddings scaled by sqrt(n_embd) on the first stage; later stages get hidden states.
    ggml_tensor * build_inputs_scaled() {
        ggml_tensor * x = build_inputs();
        return w.is_first() ? ggml_scale(ctx, x, sqrtf((float) hp.n_embd)) : x;
    }

    // Q, K, V: projected, Q and K normed per head and roped with the layer's base, Q pre-scaled.
    void build_qkv(int il, const layer_weights & L, ggml_tensor * cur, ggml_tensor *& Q, ggml_tensor *& K,
                   ggml_tensor *& V) {
        const bool swa = hp.is_swa(il);
        const float base = swa ? hp.rope_freq_base_swa : hp.rope_freq_base;
        const float scale = swa ? hp.rope_freq_scale_swa : hp.rope_freq_scale;
        Q = ggml_reshape_3d(ctx, mul_mat_rows(ctx, L.wq, cur, inv), d_head, n_head, n_tokens);
        K = ggml_reshape_3d(ctx, mul_mat_rows(ctx, L.wk, cur, inv), d_head, n_head_kv, n_tokens);
        V = ggml_reshape_3d(ctx, mul_mat_rows(ctx, L.wv, cur, inv), d_head, n_head_kv, n_tokens);
        Q = rope(norm_rms(ctx, Q, L.attn_q_norm, hp.f_norm_rms_eps), base, scale);
        K = rope(norm_rms(ctx, K, L.attn_k_norm, hp.f_norm_rms_eps), base, scale);
        Q = ggml_scale(ctx, Q, hp.f_attention_scale);
        ggml_build_forward_expand(gf, Q);
        ggml_build_forward_expand(gf, K);
        ggml_build_forward_expand(gf, V);
    }

    // GELU-gated feed-forward, post-normed: post_norm(down(gelu(gate x) * up x)).
    ggml_tensor * build_ffn(const layer_weights & L, ggml_tensor * x) {
        ggml_tensor * up   = mul_mat_rows(ctx, L.ffn_up, x, inv);
        ggml_tensor * gate = mul_mat_rows(ctx, L.ffn_gate, x, inv);
        ggml_tensor * cur  = mul_mat_rows(ctx, L.ffn_down, ggml_geglu_split(ctx, gate, up), inv);
        return norm_rms(ctx, cur, L.ffn_post_norm, hp.f_norm_rms_eps);
    }

    // One decoder layer (local index li); null when the model's last layer has no rows to output.
    ggml_tensor * build_layer(int li, ggml_tensor * inpL, layer_progress & progress) {
        const layer_weights & L = w.layers[li];
        const int il = w.layer_begin + li;
        const bool model_last_layer = il == (int) hp.n_layer - 1;
        ggml_tensor *Q, *K, *V;
        build_qkv(il, L, norm_rms(ctx, inpL, L.attn_norm, hp.f_norm_rms_eps), Q, K, V);
        build_kv_store(li, K, V);
        if (model_last_layer && w.is_last() && shape.n_outputs == 0) return nullptr;

        // Queries are already scaled: the softmax scale is 1.
        ggml_tensor * mask = hp.is_swa(il) ? in.kq_mask_swa : in.kq_mask;
        ggml_tensor * cur = mul_mat_rows(ctx, L.wo, build_attn(li, Q, mask, 1.0f), inv);
        if (model_last_layer && in.out_ids) {
            cur  = ggml_get_rows(ctx, cur, in.out_ids);
            inpL = ggml_get_rows(ctx, inpL, in.out_ids);
        }
        ggml_tensor * sa_out = ggml_add(ctx, norm_rms(ctx, cur, L.attn_post_norm, hp.f_norm_rms_eps), inpL);
        cur = build_ffn(L, norm_rms(ctx, sa_out, L.ffn_norm, hp.f_norm_rms_eps));
        return mark_layer(li, ggml_add(ctx, cur, sa_out), progress);
    }

    // Output norm, tied LM head and logit softcapping on the last stage; the hidden states elsewhere.
    ggml_tensor * build_output(ggml_tensor * out) {
        if (w.is_last()) {
            out = norm_rms(ctx, out, w.output_norm, hp.f_norm_rms_eps);
            out = mul_mat_rows(ctx, w.output, out, shape.invariant && out->ne[1] > 1);
            const float cap = hp.f_final_logit_softcapping;
            if (cap > 0.0f) out = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, out, 1.0f / cap)), cap);
        }
        ggml_set_output(out);
        ggml_build_forward_expand(gf, out);
        return out;
    }
};

}  // namespace

void gemma3_read_hparams(const gguf_file & f, model_hparams & hp) {
    const std::string a = "gemma3.";
    hp.n_swa = (uint32_t) f.get_uint(a + "attention.sliding_window", 0, false);
    read_swa_pattern(f, a + "attention.sliding_window_pattern", hp);
    hp.rope_freq_base_swa = f.get_f32(a + "rope.freq_base_swa", 10000.0f);
    hp.rope_freq_scale_swa = 1.0f;
    hp.f_final_logit_softcapping = f.get_f32(a + "final_logit_softcapping", 0.0f);
    // As llama.cpp (after gemma_pytorch's config): 1/sqrt(n_embd/n_head) for the 27B model (62
    // layers), 1/sqrt(head size) for the others.
    hp.f_attention_scale = hp.n_layer == 62 ? 1.0f / std::sqrt(float(hp.n_embd / hp.n_head))
                                            : 1.0f / std::sqrt(float(hp.n_embd_head));
}

ggml_tensor * gemma3_graph_build(ggml_context * ctx, ggml_cgraph * gf, const stage_weights & w, const kv_cache & kv,
                                 const kv_cache * kv_swa, const graph_shape & shape, graph_inputs & in,
                                 layer_progress & progress) {
    gemma3_graph g(ctx, gf, w, kv, kv_swa, shape, in);
    return build_stage(g, g.build_inputs_scaled(), progress);
}

}  // namespace pipeinfer
