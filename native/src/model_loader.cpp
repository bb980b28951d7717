#include "model_loader.h"

#include "arch_gemma3.h"
#include "cpu_backend.h"
#include "errors.h"
#include "gguf_file.h"
#include "gguf_slice.h"
#include "huge_pages.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>

namespace pipeinfer {

namespace {

std::string fmt_shape(const int64_t * ne) {
    std::string s = "[";
    for (int i = 0; i < GGML_MAX_DIMS; ++i) {
        if (i > 0 && ne[i] == 1) {
            bool rest_one = true;
            for (int j = i; j < GGML_MAX_DIMS; ++j) rest_one &= ne[j] == 1;
            if (rest_one) break;
        }
        s += (i ? ", " : "") + std::to_string(ne[i]);
    }
    return s + "]";
}

struct ggml_ctx_deleter { void operator()(ggml_context * c) const { ggml_free(c); } };

constexpr uint32_t max_experts = 512;  // llama.cpp's LLAMA_MAX_EXPERTS

// Sizes of the decoder; refuses what the engine cannot compute (MoE, odd head sizes).
void read_sizes(const gguf_file & f, const std::string & a, model_hparams & hp) {
    const std::string & path = f.path();
    // One number, not a per-layer array: `inspect` and the job plan read it as one (gguf_metadata).
    if (f.is_array(a + "block_count")) throw model_file_error(path + ": " + a + "block_count is an array, not a number");
    // Sizes are 32-bit in the engine (as in llama.cpp): a larger value is refused, never truncated.
    auto u32 = [&](const std::string & key, uint64_t def, bool required) {
        const uint64_t v = f.get_uint(key, def, required);
        if (v > UINT32_MAX) throw model_file_error(path + ": " + key + " = " + std::to_string(v) + " is out of range");
        return (uint32_t) v;
    };
    hp.n_layer   = u32(a + "block_count", 0, true);
    hp.n_embd    = u32(a + "embedding_length", 0, true);
    hp.n_ff      = u32(a + "feed_forward_length", 0, true);
    hp.n_head    = u32(a + "attention.head_count", 0, true);
    hp.n_head_kv = u32(a + "attention.head_count_kv", hp.n_head, false);
    hp.n_ctx_train = u32(a + "context_length", 0, true);
    hp.f_norm_rms_eps = f.get_f32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
    if (hp.n_layer == 0 || hp.n_embd == 0 || hp.n_head == 0 || hp.n_head_kv == 0 || hp.n_ff == 0 ||
        hp.n_head % hp.n_head_kv != 0) {
        throw model_file_error(path + ": inconsistent hyperparameters (block_count=" + std::to_string(hp.n_layer) +
                               ", embedding_length=" + std::to_string(hp.n_embd) + ", head_count=" +
                               std::to_string(hp.n_head) + ", head_count_kv=" + std::to_string(hp.n_head_kv) + ")");
    }
    // The head size is attention.key_length when the file has it (Qwen3: 128 with n_embd/n_head = 64
    // in the 0.6B model), else n_embd/n_head, as llama.cpp resolves it.
    const bool has_key_len = gguf_find_key(f.ctx(), (a + "attention.key_length").c_str()) >= 0;
    if (!has_key_len && hp.n_embd % hp.n_head != 0) {
        throw model_file_error(path + ": embedding_length (" + std::to_string(hp.n_embd) + ") is not a multiple of "
                               "head_count (" + std::to_string(hp.n_head) + ") and the file has no attention.key_length");
    }
    hp.n_embd_head = (uint32_t) f.get_uint(a + "attention.key_length", has_key_len ? 0 : hp.n_embd / hp.n_head, false);
    const uint32_t val_len = (uint32_t) f.get_uint(a + "attention.value_length", hp.n_embd_head, false);
    if (hp.n_embd_head == 0 || val_len != hp.n_embd_head) {
        throw model_file_error(path + ": attention.key_length (" + std::to_string(hp.n_embd_head) +
                               ") and attention.value_length (" + std::to_string(val_len) +
                               ") must be equal and non-zero; other head sizes are not supported");
    }
}

// Mixture of experts: llama files with expert_count > 0 (Mixtral-style) and qwen3moe. As in
// llama.cpp 0.3.36, both route with a softmax over the experts, take the top expert_used_count and
// renormalise their weights to sum to 1 (qwen3moe's norm_topk_prob; for llama it is the same as a
// softmax over the chosen experts), with no weight scale and no shared expert.
void read_experts(const gguf_file & f, const std::string & a, model_hparams & hp) {
    const std::string & path = f.path();
    const bool has_experts = hp.arch == "llama" || hp.arch == "qwen3moe";
    hp.n_expert = has_experts ? (uint32_t) f.get_uint(a + "expert_count", 0, hp.arch == "qwen3moe") : 0;
    if (hp.n_expert == 0) {
        if (hp.arch == "qwen3moe") throw model_file_error(path + ": " + a + "expert_count must be > 0 for qwen3moe");
        return;
    }
    hp.n_expert_used = (uint32_t) f.get_uint(a + "expert_used_count", 0, true);
    if (hp.n_expert > max_experts || hp.n_expert_used == 0 || hp.n_expert_used > hp.n_expert) {
        throw model_file_error(path + ": inconsistent experts (expert_count=" + std::to_string(hp.n_expert) +
                               ", expert_used_count=" + std::to_string(hp.n_expert_used) + "); need 1 <= "
                               "expert_used_count <= expert_count <= " + std::to_string(max_experts));
    }
    // llama experts are n_ff wide; qwen3moe's have their own width (n_ff / n_expert_used if unset).
    hp.n_ff_exp = hp.arch == "llama"
        ? hp.n_ff : (uint32_t) f.get_uint(a + "expert_feed_forward_length", hp.n_ff / hp.n_expert_used, false);
    if (hp.n_ff_exp == 0) throw model_file_error(path + ": " + a + "expert_feed_forward_length must be > 0");
}

// RoPE: style, base and scaling, resolved the way llama.cpp resolves its context params when the
// user sets nothing.
void read_rope(const gguf_file & f, const std::string & a, model_hparams & hp) {
    const std::string & path = f.path();
    hp.n_rot = (uint32_t) f.get_uint(a + "rope.dimension_count", hp.n_embd_head, false);
    if (hp.n_rot != hp.n_embd_head) {
        throw model_file_error(path + ": rope.dimension_count (" + std::to_string(hp.n_rot) +
                               ") must equal the head size (" + std::to_string(hp.n_embd_head) + ")");
    }
    // llama rotates adjacent pairs, the qwen family and gemma3 rotate halves (GPT-NeoX style).
    hp.rope_type = hp.arch == "llama" ? 0 : GGML_ROPE_TYPE_NEOX;
    hp.rope_freq_base = f.get_f32(a + "rope.freq_base", 10000.0f);

    const std::string scaling = f.get_str(a + "rope.scaling.type", "linear", false);
    float factor = f.get_f32(a + "rope.scaling.factor", 0.0f);
    if (factor == 0.0f) factor = f.get_f32(a + "rope.scale_linear", 0.0f);
    hp.rope_freq_scale = factor == 0.0f ? 1.0f : 1.0f / factor;
    hp.n_ctx_orig_yarn = (uint32_t) f.get_uint(a + "rope.scaling.original_context_length", hp.n_ctx_train, false);
    if (scaling == "none") {
        hp.rope_freq_scale = 1.0f;
    } else if (scaling == "yarn") {
        hp.yarn_ext_factor = 1.0f;
        // llama.cpp sets mscale = 1 + 0.1 ln(factor) and then cancels it (ggml's rope applies it
        // again); compute it in the same float steps so that the result rounds the same way.
        const float fac = 1.0f / hp.rope_freq_scale;
        const float mscale = fac <= 1.0f ? 1.0f : 0.1f * logf(fac) + 1.0f;
        hp.yarn_attn_factor = mscale * (1.0f / (1.0f + 0.1f * logf(fac)));
    } else if (scaling != "linear") {
        throw model_file_error(path + ": rope scaling type '" + printable(scaling) + "' is not supported (none, linear, yarn)");
    }
    hp.yarn_attn_factor *= f.get_f32(a + "rope.scaling.attn_factor", 1.0f);
}

model_hparams read_hparams(const gguf_file & f) {
    model_hparams hp;
    hp.arch = f.get_str("general.architecture", "", true);
    const auto & archs = supported_archs();
    if (std::find(archs.begin(), archs.end(), hp.arch) == archs.end()) {
        std::string names;
        for (const auto & n : archs) names += (names.empty() ? "" : ", ") + n;
        throw model_file_error(f.path() + ": unsupported architecture '" + printable(hp.arch) +
                               "'; the native engine supports: " + names);
    }
    const std::string a = hp.arch + ".";
    read_sizes(f, a, hp);
    read_experts(f, a, hp);
    read_rope(f, a, hp);
    if (hp.arch == "gemma3") gemma3_read_hparams(f, hp);
    const int64_t tid = gguf_find_tensor(f.ctx(), "token_embd.weight");
    if (tid >= 0) {
        hp.n_vocab = (uint32_t) gguf_get_tensor_ne(f.ctx(), tid)[1];
    } else if (gguf_find_key(f.ctx(), slice_key_n_vocab) >= 0) {
        hp.n_vocab = (uint32_t) f.get_uint(slice_key_n_vocab, 0, true);  // a rank slice (gguf_slice.h)
    } else {
        throw model_file_error(f.path() + ": tensor 'token_embd.weight' is missing");
    }
    return hp;
}

// One tensor the stage needs: where it is in the file and where it goes.
struct tensor_request {
    std::string file_name;     // name in the GGUF file
    std::string name;          // name given to the loaded tensor (differs for the tied output)
    ggml_tensor ** dst;        // field of stage_weights/layer_weights to set
    std::vector<int64_t> ne;   // expected shape
    bool is_matmul_weight;     // used as src0 of MUL_MAT: a candidate for the repack buffer types
    bool required;
    bool is_expert = false;    // src0 of MUL_MAT_ID (ffn_*_exps), not of MUL_MAT
    // Filled by locate_tensors; meta stays null for an optional tensor the file does not have.
    const ggml_tensor * meta = nullptr;
    uint64_t offset = 0;       // absolute offset of the data in the file
    ggml_backend_buffer_type_t buft = nullptr;  // filled by choose_buffer_types
};

// A mixture-of-experts layer's FFN: the router (a MUL_MAT weight) and the stacked experts (MUL_MAT_ID).
void add_expert_tensors(const std::string & p, layer_weights & L, const model_hparams & hp,
                        std::vector<tensor_request> & req) {
    const int64_t E = hp.n_embd, X = hp.n_expert, Fe = hp.n_ff_exp;
    req.push_back({p + "ffn_gate_inp.weight", p + "ffn_gate_inp.weight", &L.ffn_gate_inp, {E, X}, true, true});
    // llama.cpp loads a llama MoE without gate experts (the FFN is then SiLU(up)); qwen3moe needs them.
    const bool gate_required = hp.arch != "llama";
    const struct { const char * name; ggml_tensor ** dst; std::vector<int64_t> ne; bool required; } exps[] = {
        {"ffn_gate_exps.weight", &L.ffn_gate_exps, {E, Fe, X}, gate_required},
        {"ffn_up_exps.weight",   &L.ffn_up_exps,   {E, Fe, X}, true},
        {"ffn_down_exps.weight", &L.ffn_down_exps, {Fe, E, X}, true},
    };
    for (const auto & e : exps) {
        req.push_back({p + e.name, p + e.name, e.dst, e.ne, true, e.required});
        req.back().is_expert = true;
    }
}

// The tensors of the stage: its layers, plus token_embd on the first stage and the output norm and
// LM head (or the tied token_embd) on the last.
std::vector<tensor_request> stage_tensors(const gguf_file & f, stage_weights & sw) {
    const model_hparams & hp = sw.hparams;
    const int64_t E = hp.n_embd, V = hp.n_vocab, F = hp.n_ff, Q = hp.n_embd_q(), G = hp.n_embd_gqa(),
                  D = hp.n_embd_head;
    const bool qwen2 = hp.arch == "qwen2";
    const bool qk_norm = hp.arch == "qwen3" || hp.arch == "qwen3moe" || hp.arch == "gemma3";  // per-head RMS norms of Q and K before RoPE
    std::vector<tensor_request> req;
    auto add = [&](const std::string & fname, ggml_tensor ** dst, std::vector<int64_t> ne, bool mm, bool required,
                   const std::string & as = "") {
        req.push_back({fname, as.empty() ? fname : as, dst, std::move(ne), mm, required});
    };
    if (sw.is_first()) add("token_embd.weight", &sw.tok_embd, {E, V}, false, true);
    if (hp.arch == "llama" && f.has_tensor("rope_freqs.weight")) {
        add("rope_freqs.weight", &sw.rope_freqs, {hp.n_rot / 2}, false, true);
    }
    for (int il = sw.layer_begin; il < sw.layer_end; ++il) {
        layer_weights & L = sw.layers[il - sw.layer_begin];
        const std::string p = "blk." + std::to_string(il) + ".";
        add(p + "attn_norm.weight",   &L.attn_norm, {E},    false, true);
        add(p + "attn_q.weight",      &L.wq,        {E, Q}, true,  true);
        add(p + "attn_k.weight",      &L.wk,        {E, G}, true,  true);
        add(p + "attn_v.weight",      &L.wv,        {E, G}, true,  true);
        add(p + "attn_output.weight", &L.wo,        {Q, E}, true,  true);
        add(p + "attn_q.bias",        &L.bq,        {Q},    false, qwen2);
        add(p + "attn_k.bias",        &L.bk,        {G},    false, qwen2);
        add(p + "attn_v.bias",        &L.bv,        {G},    false, qwen2);
        add(p + "attn_output.bias",   &L.bo,        {E},    false, false);
        if (qk_norm) {
            add(p + "attn_q_norm.weight", &L.attn_q_norm, {D}, false, true);
            add(p + "attn_k_norm.weight", &L.attn_k_norm, {D}, false, true);
        }
        add(p + "ffn_norm.weight",    &L.ffn_norm,  {E},    false, true);
        if (hp.n_expert > 0) {
            add_expert_tensors(p, L, hp, req);
        } else {
            add(p + "ffn_gate.weight", &L.ffn_gate, {E, F}, true, true);
            add(p + "ffn_up.weight",   &L.ffn_up,   {E, F}, true, true);
            add(p + "ffn_down.weight", &L.ffn_down, {F, E}, true, true);
        }
        if (hp.arch == "gemma3") {
            add(p + "post_attention_norm.weight", &L.attn_post_norm, {E}, false, true);
            add(p + "post_ffw_norm.weight",       &L.ffn_post_norm,  {E}, false, true);
        }
    }
    if (sw.is_last()) {
        add("output_norm.weight", &sw.output_norm, {E}, false, true);
        if (f.has_tensor("output.weight")) {
            add("output.weight", &sw.output, {E, V}, true, true);
        } else {
            // Tied embeddings: a second copy of token_embd that may be repacked for the LM head.
            add("token_embd.weight", &sw.output, {E, V}, true, true, "output.weight");
        }
        add("output.bias", &sw.output_b, {V}, false, false);
    }
    return req;
}

// Why ggml's CPU kernels cannot use a weight of this type in the op the stage puts it in, or null.
// A file can declare any ggml type for any tensor, and ggml does not refuse at graph build: it
// aborts the process at compute (MUL with an f16 norm) or calls a null vec_dot (MUL_MAT on i32).
const char * weight_type_problem(const tensor_request & r, ggml_type t) {
    if (r.is_matmul_weight) {  // MUL_MAT / MUL_MAT_ID src0 (also the tied token_embd copy)
        return cpu_has_vec_dot(t) ? nullptr : "a type with no matrix-multiply kernel";
    }
    if (r.file_name == "token_embd.weight") {  // GET_ROWS: converts rows to f32
        const bool rows_ok = t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 ||
                             (ggml_is_quantized(t) && ggml_get_type_traits(t)->to_float);
        return rows_ok ? nullptr : "a type whose rows cannot be read as f32";
    }
    // Norm weights, biases and RoPE frequency factors: element-wise ops on f32 activations.
    return t == GGML_TYPE_F32 ? nullptr : "not f32 (norms, biases and rope_freqs must be f32)";
}

// Validates every tensor before anything is allocated: presence, shape, type, bounds in the file.
void locate_tensors(const gguf_file & f, std::vector<tensor_request> & req) {
    const std::string & path = f.path();
    const uint64_t data_offset = gguf_get_data_offset(f.ctx());
    for (tensor_request & r : req) {
        const int64_t tid = gguf_find_tensor(f.ctx(), r.file_name.c_str());
        if (tid < 0) {
            if (r.required) {
                throw model_file_error(path + ": required tensor '" + r.file_name + "' is missing from the file");
            }
            continue;
        }
        const ggml_tensor * m = ggml_get_tensor(f.tensor_meta(), r.file_name.c_str());
        if (!m) throw model_file_error(path + ": tensor '" + r.file_name + "' has no metadata");
        int64_t want[GGML_MAX_DIMS] = {1, 1, 1, 1};
        for (size_t d = 0; d < r.ne.size(); ++d) want[d] = r.ne[d];
        for (int d = 0; d < GGML_MAX_DIMS; ++d) {
            if (m->ne[d] != want[d]) {
                throw model_file_error(path + ": tensor '" + r.file_name + "' has shape " + fmt_shape(m->ne) +
                                       ", expected " + fmt_shape(want));
            }
        }
        if (const char * why = weight_type_problem(r, m->type)) {
            throw model_file_error(path + ": tensor '" + r.file_name + "' has type " + ggml_type_name(m->type) +
                                   ", " + why);
        }
        const uint64_t off = data_offset + gguf_get_tensor_offset(f.ctx(), tid);
        if (off + ggml_nbytes(m) > f.file_size()) {
            throw model_file_error(path + ": file is truncated: tensor '" + r.file_name + "' ends at byte " +
                                   std::to_string(off + ggml_nbytes(m)) + " but the file has " +
                                   std::to_string(f.file_size()) + " bytes");
        }
        r.meta = m;
        r.offset = off;
    }
}

// Mirrors llama.cpp's weight_buft_supported for MUL_MAT (and MUL_MAT_ID for experts, n_expert_used
// > 0): ask the device whether it can run the op with the weight in a buffer of this type.
bool buft_supports_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const ggml_tensor * meta,
                          int64_t n_expert_used) {
    ggml_init_params ip = { ggml_tensor_overhead() * 8, nullptr, true };
    std::unique_ptr<ggml_context, ggml_ctx_deleter> ctx(ggml_init(ip));
    if (!ctx) return false;
    ggml_tensor * w = ggml_dup_tensor(ctx.get(), meta);
    ggml_tensor * op;
    if (n_expert_used > 0) {  // an expert stack: the MUL_MAT_ID llama.cpp probes with
        ggml_tensor * b = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, w->ne[0], n_expert_used, 512);
        ggml_tensor * ids = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, n_expert_used, 512);
        op = ggml_mul_mat_id(ctx.get(), w, b, ids);
    } else {
        ggml_tensor * b = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, w->ne[0], 512, w->ne[2], w->ne[3]);
        op = ggml_mul_mat(ctx.get(), w, b);
    }
    w->buffer = ggml_backend_buft_alloc_buffer(buft, 0);
    if (!w->buffer) return false;
    const bool ok = ggml_backend_dev_supports_op(dev, op);
    ggml_backend_buffer_free(w->buffer);
    w->buffer = nullptr;
    return ok;
}

void pread_all(int fd, void * dst, size_t n, uint64_t offset, const std::string & path, const std::string & tname) {
    char * p = (char *) dst;
    while (n > 0) {
        const ssize_t got = ::pread(fd, p, n, (off_t) offset);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            throw model_file_error(path + ": failed to read tensor '" + tname + "' (file truncated or unreadable)");
        }
        p += got;
        n -= (size_t) got;
        offset += (uint64_t) got;
    }
}

// Chooses a buffer type per tensor: the first extra buffer type (CPU_REPACK, ...) whose device
// can run MUL_MAT with it, else the plain CPU buffer type. Returns the plain CPU buffer type.
ggml_backend_buffer_type_t choose_buffer_types(std::vector<tensor_request> & req, bool use_repack,
                                               int64_t n_expert_used) {
    ggml_backend_dev_t cpu_dev = cpu_device();
    ggml_backend_buffer_type_t cpu_buft = ggml_backend_dev_buffer_type(cpu_dev);
    std::vector<ggml_backend_buffer_type_t> extra;
    if (use_repack) {
        ggml_backend_reg_t cpu_reg = ggml_backend_dev_backend_reg(cpu_dev);
        auto get_extra = (ggml_backend_dev_get_extra_bufts_t)
            ggml_backend_reg_get_proc_address(cpu_reg, "ggml_backend_dev_get_extra_bufts");
        if (get_extra) {
            for (ggml_backend_buffer_type_t * b = get_extra(cpu_dev); b && *b; ++b) extra.push_back(*b);
        }
    }
    for (tensor_request & r : req) {
        r.buft = cpu_buft;
        if (!r.meta || !r.is_matmul_weight) continue;
        for (auto * b : extra) {
            if (buft_supports_matmul(cpu_dev, b, r.meta, r.is_expert ? n_expert_used : 0)) {
                r.buft = b;
                break;
            }
        }
    }
    return cpu_buft;
}

// One context + buffer per buffer type; creates the stage's tensors and points the weight fields at them.
void allocate_tensors(std::vector<tensor_request> & req, stage_weights & sw) {
    std::map<ggml_backend_buffer_type_t, size_t> count;
    for (const tensor_request & r : req) count[r.buft] += r.meta != nullptr;
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    for (const auto & [buft, n] : count) {
        if (n == 0) continue;
        ggml_init_params ip = { ggml_tensor_overhead() * (n + 1), nullptr, true };
        ggml_context * c = ggml_init(ip);
        if (!c) throw engine_failure("failed to create a ggml context for the weights");
        sw.ctxs.push_back(c);
        ctx_of[buft] = c;
    }
    for (tensor_request & r : req) {
        if (!r.meta) continue;
        ggml_tensor * t = ggml_dup_tensor(ctx_of[r.buft], r.meta);
        ggml_set_name(t, r.name.c_str());
        *r.dst = t;
    }
    for (auto & [buft, c] : ctx_of) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            throw engine_failure(std::string("failed to allocate the weight buffer (") + ggml_backend_buft_name(buft) + ")");
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        advise_huge_pages(buf);  // before read_tensors touches its pages
        sw.buffers.push_back(buf);
    }
}

// Reads the data. Host buffers are filled in place; extra buffer types repack in set_tensor,
// which wants the whole tensor at once, so those go through a scratch buffer.
void read_tensors(const gguf_file & f, const std::vector<tensor_request> & req, ggml_backend_buffer_type_t cpu_buft,
                  stage_weights & sw) {
    std::vector<uint8_t> scratch;
    for (const tensor_request & r : req) {
        ggml_tensor * t = r.meta ? *r.dst : nullptr;
        if (!t) continue;
        const size_t nb = ggml_nbytes(t);
        if (r.buft == cpu_buft) {
            pread_all(f.fd(), t->data, nb, r.offset, f.path(), r.file_name);
        } else {
            scratch.resize(nb);
            pread_all(f.fd(), scratch.data(), nb, r.offset, f.path(), r.file_name);
            ggml_backend_tensor_set(t, scratch.data(), 0, nb);
            sw.n_repacked++;
        }
        sw.weight_bytes += nb;
        if (r.is_expert) sw.expert_bytes += nb;
    }
}

}  // namespace

const std::vector<std::string> & supported_archs() {
    static const std::vector<std::string> archs = {"llama", "qwen2", "qwen3", "qwen3moe", "gemma3"};
    return archs;
}

stage_weights::~stage_weights() {
    for (auto * b : buffers) ggml_backend_buffer_free(b);
    for (auto * c : ctxs) ggml_free(c);
}

std::unique_ptr<stage_weights> stage_weights_load(const std::string & path, int layer_begin, int layer_end,
                                                  bool use_repack) {
    const gguf_file f(path, /*with_tensor_meta=*/ true);
    auto sw = std::make_unique<stage_weights>();
    sw->hparams = read_hparams(f);
    const int n_layer = (int) sw->hparams.n_layer;
    if (layer_begin < 0 || layer_end > n_layer || layer_begin >= layer_end) {
        throw invalid_input("layer range [" + std::to_string(layer_begin) + ", " + std::to_string(layer_end) +
                            ") is out of bounds: " + path + " has " + std::to_string(n_layer) +
                            " layers, so 0 <= layer_begin < layer_end <= " + std::to_string(n_layer));
    }
    sw->layer_begin = layer_begin;
    sw->layer_end   = layer_end;
    sw->layers.resize(layer_end - layer_begin);

    std::vector<tensor_request> req = stage_tensors(f, *sw);
    locate_tensors(f, req);
    ggml_backend_buffer_type_t cpu_buft = choose_buffer_types(req, use_repack, sw->hparams.n_expert_used);
    allocate_tensors(req, *sw);
    read_tensors(f, req, cpu_buft, *sw);
    return sw;
}

}  // namespace pipeinfer
