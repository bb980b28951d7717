// Loads the hyperparameters and the tensors of one layer range of a GGUF file (the architectures
// of supported_archs(): llama, also with experts, qwen2, qwen3, qwen3moe, gemma3).
//
// Only the tensors the range needs are read: the layers [layer_begin, layer_end), plus
// token_embd on the first stage and output_norm/output (or the tied token_embd) on the last one.
// Tensors are read with pread into backend buffers (no mmap of the whole file), so the resident
// memory of a stage is its share of the weights. Matrix weights go to the CPU "extra" buffer types
// (CPU_REPACK) when the CPU device supports a MUL_MAT with them there, like llama.cpp's loader.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pipeinfer {

// Hyperparameters read from the GGUF metadata; field names follow llama.cpp's llama_hparams.
struct model_hparams {
    std::string arch;             // general.architecture, one of supported_archs()
    uint32_t n_layer     = 0;     // layers in the whole file
    uint32_t n_embd      = 0;     // hidden size
    uint32_t n_head      = 0;     // query heads
    uint32_t n_head_kv   = 0;     // key/value heads (GQA when < n_head)
    uint32_t n_embd_head = 0;     // head size of q, k and v (attention.key_length, else n_embd/n_head)
    uint32_t n_ff        = 0;     // feed-forward size
    uint32_t n_vocab     = 0;     // rows of token_embd
    uint32_t n_ctx_train = 0;     // context_length the model was trained with
    float    f_norm_rms_eps = 1e-5f;

    int      rope_type       = 0;        // 0 = normal (llama), GGML_ROPE_TYPE_NEOX (qwen2)
    uint32_t n_rot           = 0;        // rotated dims per head (rope.dimension_count)
    float    rope_freq_base  = 10000.0f; // rope.freq_base
    float    rope_freq_scale = 1.0f;     // 1/rope.scaling.factor (linear or yarn), else 1
    uint32_t n_ctx_orig_yarn = 0;        // rope.scaling.original_context_length
    float    yarn_ext_factor = 0.0f;     // 1 for yarn scaling, else 0 (llama.cpp's default)
    float    yarn_attn_factor = 1.0f;    // magnitude correction, computed as llama.cpp does
    float    yarn_beta_fast  = 32.0f;
    float    yarn_beta_slow  = 1.0f;

    // Mixture of experts (read_experts in model_loader.cpp, graph in ffn_moe.cpp); 0 experts: dense FFN.
    uint32_t n_expert      = 0;      // expert_count: experts per layer
    uint32_t n_expert_used = 0;      // expert_used_count: experts each token is routed to (top-k)
    uint32_t n_ff_exp      = 0;      // rows of one expert's gate/up matrices

    // gemma3: sliding-window attention, scales and norms (read in arch_gemma3.cpp).
    uint32_t n_swa = 0;                     // attention.sliding_window; 0 = every layer attends to all
    std::vector<uint8_t> swa_layers;        // [n_layer] 1 = sliding-window ("local") layer
    float rope_freq_base_swa  = 10000.0f;   // rope.freq_base_swa of the local layers
    float rope_freq_scale_swa = 1.0f;       // local layers are never rope-scaled
    float f_attention_scale = 0.0f;         // queries are multiplied by it before attention (0 = not)
    float f_final_logit_softcapping = 0.0f; // logits = c*tanh(logits/c) when > 0

    uint32_t n_embd_gqa() const { return n_embd_head * n_head_kv; }  // width of one K or V row
    uint32_t n_embd_q() const { return n_embd_head * n_head; }       // width of Q (may differ from n_embd)
    bool is_swa(int il) const { return n_swa > 0 && swa_layers[il]; }
};

// Weights of one transformer layer. Biases are null when the file has none (llama).
struct layer_weights {
    ggml_tensor * attn_norm = nullptr;  // [n_embd]
    ggml_tensor * wq = nullptr;         // [n_embd, n_embd_head*n_head]
    ggml_tensor * wk = nullptr;         // [n_embd, n_embd_gqa]
    ggml_tensor * wv = nullptr;         // [n_embd, n_embd_gqa]
    ggml_tensor * wo = nullptr;         // [n_embd_head*n_head, n_embd]
    ggml_tensor * bq = nullptr;         // qwen2 only
    ggml_tensor * bk = nullptr;
    ggml_tensor * bv = nullptr;
    ggml_tensor * bo = nullptr;         // optional
    ggml_tensor * ffn_norm = nullptr;   // [n_embd]
    ggml_tensor * ffn_gate = nullptr;   // [n_embd, n_ff]
    ggml_tensor * ffn_up   = nullptr;   // [n_embd, n_ff]
    ggml_tensor * ffn_down = nullptr;   // [n_ff, n_embd]
    // qwen3, qwen3moe, gemma3: RMS norms of each Q and K head before RoPE.
    ggml_tensor * attn_q_norm = nullptr;  // [n_embd_head]
    ggml_tensor * attn_k_norm = nullptr;  // [n_embd_head]
    // Mixture of experts (then ffn_gate/ffn_up/ffn_down are null).
    ggml_tensor * ffn_gate_inp  = nullptr;  // router [n_embd, n_expert]
    ggml_tensor * ffn_gate_exps = nullptr;  // [n_embd, n_ff_exp, n_expert]; optional for llama (then SiLU(up))
    ggml_tensor * ffn_up_exps   = nullptr;  // [n_embd, n_ff_exp, n_expert]
    ggml_tensor * ffn_down_exps = nullptr;  // [n_ff_exp, n_embd, n_expert]
    // gemma3
    ggml_tensor * attn_post_norm = nullptr;  // [n_embd] after attention, before the residual
    ggml_tensor * ffn_post_norm = nullptr;   // [n_embd] after the FFN, before the residual
};

// Everything one stage computes with. Owns the ggml contexts and backend buffers of its tensors.
struct stage_weights {
    model_hparams hparams;
    int layer_begin = 0;                 // first layer of the range (global index)
    int layer_end   = 0;                 // one past the last layer
    bool is_first() const { return layer_begin == 0; }
    bool is_last()  const { return layer_end == (int) hparams.n_layer; }

    ggml_tensor * tok_embd    = nullptr; // first stage: [n_embd, n_vocab], used by GET_ROWS
    ggml_tensor * rope_freqs  = nullptr; // optional llama3 rope factors [n_rot/2]
    ggml_tensor * output_norm = nullptr; // last stage: [n_embd]
    ggml_tensor * output      = nullptr; // last stage: [n_embd, n_vocab] (a copy of token_embd if tied)
    ggml_tensor * output_b    = nullptr; // optional output bias [n_vocab]
    std::vector<layer_weights> layers;   // layers[i] is global layer layer_begin + i

    size_t weight_bytes = 0;             // bytes of all tensors loaded
    size_t n_repacked   = 0;             // tensors placed in an extra (repack) buffer type
    size_t expert_bytes = 0;             // of weight_bytes: the experts' matrices (ffn_*_exps)

    std::vector<ggml_context *>          ctxs;     // one per buffer type used
    std::vector<ggml_backend_buffer_t>   buffers;  // matching buffers

    ~stage_weights();
};

// Architectures the engine computes (general.architecture values), in the order error messages list them.
const std::vector<std::string> & supported_archs();

// Reads and validates the file; throws model_file_error / invalid_input with a clear message.
std::unique_ptr<stage_weights> stage_weights_load(const std::string & path, int layer_begin, int layer_end,
                                                  bool use_repack);

}  // namespace pipeinfer
