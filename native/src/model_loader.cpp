#include "model_loader.h"

#include "errors.h"
#include "ggml-cpu.h"
#include "gguf.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

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

// RAII for the raw file descriptor used for pread.
struct file_handle {
    int fd = -1;
    ~file_handle() { if (fd >= 0) close(fd); }
};

struct gguf_deleter { void operator()(gguf_context * c) const { gguf_free(c); } };
struct ggml_ctx_deleter { void operator()(ggml_context * c) const { ggml_free(c); } };

// Typed access to GGUF metadata: integers may be stored with any integer type, and per-layer
// keys (head_count...) may be arrays whose elements must then all be equal.
class gguf_reader {
public:
    gguf_reader(const gguf_context * ctx, std::string path) : ctx_(ctx), path_(std::move(path)) {}

    bool has(const std::string & key) const { return gguf_find_key(ctx_, key.c_str()) >= 0; }

    std::string get_str(const std::string & key, const std::string & def, bool required) const {
        const int64_t id = gguf_find_key(ctx_, key.c_str());
        if (id < 0) {
            if (required) missing(key);
            return def;
        }
        if (gguf_get_kv_type(ctx_, id) != GGUF_TYPE_STRING) bad_type(key, "a string");
        return gguf_get_val_str(ctx_, id);
    }

    uint64_t get_uint(const std::string & key, uint64_t def, bool required) const {
        const int64_t id = gguf_find_key(ctx_, key.c_str());
        if (id < 0) {
            if (required) missing(key);
            return def;
        }
        const gguf_type t = gguf_get_kv_type(ctx_, id);
        if (t == GGUF_TYPE_ARRAY) {
            const gguf_type at = gguf_get_arr_type(ctx_, id);
            const size_t n = gguf_get_arr_n(ctx_, id);
            if (n == 0) bad_type(key, "a non-empty array");
            const void * data = gguf_get_arr_data(ctx_, id);
            uint64_t first = 0;
            for (size_t i = 0; i < n; ++i) {
                const uint64_t v = int_at(key, at, data, i);
                if (i == 0) first = v;
                else if (v != first) {
                    throw invalid_input(path_ + ": per-layer values of '" + key +
                                        "' differ; only uniform layers are supported");
                }
            }
            return first;
        }
        return int_at(key, t, gguf_get_val_data(ctx_, id), 0);
    }

    float get_f32(const std::string & key, float def) const {
        const int64_t id = gguf_find_key(ctx_, key.c_str());
        if (id < 0) return def;
        switch (gguf_get_kv_type(ctx_, id)) {
            case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(ctx_, id);
            case GGUF_TYPE_FLOAT64: return (float) gguf_get_val_f64(ctx_, id);
            default: bad_type(key, "a float");
        }
        return def;
    }

private:
    uint64_t int_at(const std::string & key, gguf_type t, const void * data, size_t i) const {
        int64_t v = 0;
        switch (t) {
            case GGUF_TYPE_UINT8:  v = ((const uint8_t  *) data)[i]; break;
            case GGUF_TYPE_INT8:   v = ((const int8_t   *) data)[i]; break;
            case GGUF_TYPE_UINT16: v = ((const uint16_t *) data)[i]; break;
            case GGUF_TYPE_INT16:  v = ((const int16_t  *) data)[i]; break;
            case GGUF_TYPE_UINT32: v = ((const uint32_t *) data)[i]; break;
            case GGUF_TYPE_INT32:  v = ((const int32_t  *) data)[i]; break;
            case GGUF_TYPE_UINT64: v = (int64_t) ((const uint64_t *) data)[i]; break;
            case GGUF_TYPE_INT64:  v = ((const int64_t  *) data)[i]; break;
            default: bad_type(key, "an integer");
        }
        if (v < 0) bad_type(key, "a non-negative integer");
        return (uint64_t) v;
    }
    [[noreturn]] void missing(const std::string & key) const {
        throw model_file_error(path_ + ": required metadata key '" + key + "' is missing");
    }
    [[noreturn]] void bad_type(const std::string & key, const char * what) const {
        throw model_file_error(path_ + ": metadata key '" + key + "' is not " + what);
    }

    const gguf_context * ctx_;
    std::string path_;
};

model_hparams read_hparams(const gguf_reader & r, const gguf_context * gctx, const std::string & path) {
    model_hparams hp;
    hp.arch = r.get_str("general.architecture", "", true);
    if (hp.arch != "llama" && hp.arch != "qwen2") {
        throw model_file_error(path + ": unsupported architecture '" + hp.arch +
                            "'; the native engine supports: llama, qwen2");
    }
    const std::string a = hp.arch + ".";
    hp.n_layer   = (uint32_t) r.get_uint(a + "block_count", 0, true);
    hp.n_embd    = (uint32_t) r.get_uint(a + "embedding_length", 0, true);
    hp.n_ff      = (uint32_t) r.get_uint(a + "feed_forward_length", 0, true);
    hp.n_head    = (uint32_t) r.get_uint(a + "attention.head_count", 0, true);
    hp.n_head_kv = (uint32_t) r.get_uint(a + "attention.head_count_kv", hp.n_head, false);
    hp.n_ctx_train = (uint32_t) r.get_uint(a + "context_length", 0, true);
    hp.f_norm_rms_eps = r.get_f32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
    if (hp.n_layer == 0 || hp.n_embd == 0 || hp.n_head == 0 || hp.n_head_kv == 0 || hp.n_ff == 0 ||
        hp.n_embd % hp.n_head != 0 || hp.n_head % hp.n_head_kv != 0) {
        throw model_file_error(path + ": inconsistent hyperparameters (block_count=" + std::to_string(hp.n_layer) +
                               ", embedding_length=" + std::to_string(hp.n_embd) + ", head_count=" +
                               std::to_string(hp.n_head) + ", head_count_kv=" + std::to_string(hp.n_head_kv) + ")");
    }
    if (r.get_uint(a + "expert_count", 0, false) > 0) {
        throw model_file_error(path + ": mixture-of-experts models (" + a + "expert_count > 0) are not supported; "
                               "the native engine runs dense llama/qwen2 models");
    }
    hp.n_embd_head = hp.n_embd / hp.n_head;
    const uint32_t key_len = (uint32_t) r.get_uint(a + "attention.key_length", hp.n_embd_head, false);
    const uint32_t val_len = (uint32_t) r.get_uint(a + "attention.value_length", hp.n_embd_head, false);
    if (key_len != hp.n_embd_head || val_len != hp.n_embd_head) {
        throw model_file_error(path + ": attention key/value length differs from embedding_length/head_count; "
                               "not supported");
    }
    hp.n_rot = (uint32_t) r.get_uint(a + "rope.dimension_count", hp.n_embd_head, false);
    if (hp.n_rot != hp.n_embd_head) {
        throw model_file_error(path + ": rope.dimension_count (" + std::to_string(hp.n_rot) +
                               ") must equal the head size (" + std::to_string(hp.n_embd_head) + ")");
    }

    // RoPE style: llama rotates adjacent pairs, qwen2 rotates halves (GPT-NeoX style).
    hp.rope_type = hp.arch == "qwen2" ? GGML_ROPE_TYPE_NEOX : 0;
    hp.rope_freq_base = r.get_f32(a + "rope.freq_base", 10000.0f);

    // Scaling, resolved the way llama.cpp resolves its context params when the user sets nothing.
    const std::string scaling = r.get_str(a + "rope.scaling.type", "linear", false);
    float factor = r.get_f32(a + "rope.scaling.factor", 0.0f);
    if (factor == 0.0f) factor = r.get_f32(a + "rope.scale_linear", 0.0f);
    hp.rope_freq_scale = factor == 0.0f ? 1.0f : 1.0f / factor;
    hp.n_ctx_orig_yarn = (uint32_t) r.get_uint(a + "rope.scaling.original_context_length", hp.n_ctx_train, false);
    if (scaling == "none") {
        hp.rope_freq_scale = 1.0f;
    } else if (scaling == "yarn") {
        hp.yarn_ext_factor = 1.0f;
        // llama.cpp sets mscale = 1 + 0.1 ln(factor) and then cancels it (ggml's rope applies it
        // again); compute it in the same float steps so that the result rounds the same way.
        const float f = 1.0f / hp.rope_freq_scale;
        const float mscale = f <= 1.0f ? 1.0f : 0.1f * logf(f) + 1.0f;
        hp.yarn_attn_factor = mscale * (1.0f / (1.0f + 0.1f * logf(f)));
    } else if (scaling != "linear") {
        throw model_file_error(path + ": rope scaling type '" + scaling + "' is not supported (none, linear, yarn)");
    }
    hp.yarn_attn_factor *= r.get_f32(a + "rope.scaling.attn_factor", 1.0f);

    const int64_t tid = gguf_find_tensor(gctx, "token_embd.weight");
    if (tid < 0) {
        throw model_file_error(path + ": tensor 'token_embd.weight' is missing");
    }
    hp.n_vocab = (uint32_t) gguf_get_tensor_ne(gctx, tid)[1];
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
};

// Mirrors llama.cpp's weight_buft_supported for MUL_MAT: ask the device whether it can run a
// MUL_MAT whose weight lives in a buffer of this type.
bool buft_supports_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const ggml_tensor * meta) {
    ggml_init_params ip = { ggml_tensor_overhead() * 8, nullptr, true };
    std::unique_ptr<ggml_context, ggml_ctx_deleter> ctx(ggml_init(ip));
    if (!ctx) return false;
    ggml_tensor * w = ggml_dup_tensor(ctx.get(), meta);
    ggml_tensor * b = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, w->ne[0], 512, w->ne[2], w->ne[3]);
    ggml_tensor * op = ggml_mul_mat(ctx.get(), w, b);
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

}  // namespace

stage_weights::~stage_weights() {
    for (auto * b : buffers) ggml_backend_buffer_free(b);
    for (auto * c : ctxs) ggml_free(c);
}

std::unique_ptr<stage_weights> stage_weights_load(const std::string & path, int layer_begin, int layer_end,
                                                  bool use_repack) {
    // Check the magic ourselves: gguf_init_from_file's own message would only go to the log.
    file_handle fh;
    fh.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fh.fd < 0) {
        throw model_file_error(path + ": cannot open model file (" + std::strerror(errno) + ")");
    }
    struct stat st {};
    if (fstat(fh.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        throw model_file_error(path + ": not a regular file");
    }
    const uint64_t file_size = (uint64_t) st.st_size;
    char magic[4] = {0, 0, 0, 0};
    if (file_size < 4 || ::pread(fh.fd, magic, 4, 0) != 4 || std::memcmp(magic, "GGUF", 4) != 0) {
        throw model_file_error(path + ": not a GGUF file (wrong magic; expected 'GGUF' in the first 4 bytes)");
    }

    ggml_context * meta_raw = nullptr;
    gguf_init_params gp = { /*no_alloc=*/ true, /*ctx=*/ &meta_raw };
    std::unique_ptr<gguf_context, gguf_deleter> gctx(gguf_init_from_file(path.c_str(), gp));
    std::unique_ptr<ggml_context, ggml_ctx_deleter> meta(meta_raw);
    if (!gctx || !meta) {
        throw model_file_error(path + ": failed to parse the GGUF header (file truncated or corrupted)");
    }

    gguf_reader reader(gctx.get(), path);
    auto sw = std::make_unique<stage_weights>();
    sw->hparams = read_hparams(reader, gctx.get(), path);
    const model_hparams & hp = sw->hparams;

    if (layer_begin < 0 || layer_end > (int) hp.n_layer || layer_begin >= layer_end) {
        throw invalid_input("layer range [" + std::to_string(layer_begin) + ", " + std::to_string(layer_end) +
                            ") is out of bounds: " + path + " has " + std::to_string(hp.n_layer) +
                            " layers, so 0 <= layer_begin < layer_end <= " + std::to_string(hp.n_layer));
    }
    sw->layer_begin = layer_begin;
    sw->layer_end   = layer_end;
    sw->layers.resize(layer_end - layer_begin);

    const int64_t E = hp.n_embd, V = hp.n_vocab, F = hp.n_ff, Q = (int64_t) hp.n_embd_head * hp.n_head,
                  G = hp.n_embd_gqa();
    const bool qwen2 = hp.arch == "qwen2";

    std::vector<tensor_request> req;
    auto add = [&](const std::string & fname, ggml_tensor ** dst, std::vector<int64_t> ne, bool mm, bool required,
                   const std::string & as = "") {
        req.push_back({fname, as.empty() ? fname : as, dst, std::move(ne), mm, required});
    };
    if (sw->is_first()) {
        add("token_embd.weight", &sw->tok_embd, {E, V}, false, true);
    }
    if (hp.arch == "llama" && gguf_find_tensor(gctx.get(), "rope_freqs.weight") >= 0) {
        add("rope_freqs.weight", &sw->rope_freqs, {hp.n_rot / 2}, false, true);
    }
    for (int il = layer_begin; il < layer_end; ++il) {
        layer_weights & L = sw->layers[il - layer_begin];
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
        add(p + "ffn_norm.weight",    &L.ffn_norm,  {E},    false, true);
        add(p + "ffn_gate.weight",    &L.ffn_gate,  {E, F}, true,  true);
        add(p + "ffn_up.weight",      &L.ffn_up,    {E, F}, true,  true);
        add(p + "ffn_down.weight",    &L.ffn_down,  {F, E}, true,  true);
    }
    if (sw->is_last()) {
        add("output_norm.weight", &sw->output_norm, {E}, false, true);
        if (gguf_find_tensor(gctx.get(), "output.weight") >= 0) {
            add("output.weight", &sw->output, {E, V}, true, true);
        } else {
            // Tied embeddings: a second copy of token_embd that may be repacked for the LM head.
            add("token_embd.weight", &sw->output, {E, V}, true, true, "output.weight");
        }
        add("output.bias", &sw->output_b, {V}, false, false);
    }

    // Validate every tensor before allocating anything: presence, type, shape, bounds in the file.
    const uint64_t data_offset = gguf_get_data_offset(gctx.get());
    std::vector<const ggml_tensor *> metas(req.size(), nullptr);
    std::vector<uint64_t> offsets(req.size(), 0);
    for (size_t i = 0; i < req.size(); ++i) {
        const tensor_request & r = req[i];
        const int64_t tid = gguf_find_tensor(gctx.get(), r.file_name.c_str());
        if (tid < 0) {
            if (r.required) {
                throw model_file_error(path + ": required tensor '" + r.file_name + "' is missing from the file");
            }
            continue;
        }
        const ggml_tensor * m = ggml_get_tensor(meta.get(), r.file_name.c_str());
        if (!m) {
            throw model_file_error(path + ": tensor '" + r.file_name + "' has no metadata");
        }
        int64_t want[GGML_MAX_DIMS] = {1, 1, 1, 1};
        for (size_t d = 0; d < r.ne.size(); ++d) want[d] = r.ne[d];
        for (int d = 0; d < GGML_MAX_DIMS; ++d) {
            if (m->ne[d] != want[d]) {
                throw model_file_error(path + ": tensor '" + r.file_name + "' has shape " + fmt_shape(m->ne) +
                                       ", expected " + fmt_shape(want));
            }
        }
        const uint64_t off = data_offset + gguf_get_tensor_offset(gctx.get(), tid);
        if (off + ggml_nbytes(m) > file_size) {
            throw model_file_error(path + ": file is truncated: tensor '" + r.file_name + "' ends at byte " +
                                   std::to_string(off + ggml_nbytes(m)) + " but the file has " +
                                   std::to_string(file_size) + " bytes");
        }
        metas[i] = m;
        offsets[i] = off;
    }

    // Choose a buffer type per tensor: the first extra buffer type (CPU_REPACK, ...) whose device
    // can run MUL_MAT with it, else the plain CPU buffer type.
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu_dev) throw engine_failure("ggml has no CPU device");
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
    std::vector<ggml_backend_buffer_type_t> chosen(req.size(), cpu_buft);
    for (size_t i = 0; i < req.size(); ++i) {
        if (!metas[i] || !req[i].is_matmul_weight) continue;
        for (auto * b : extra) {
            if (buft_supports_matmul(cpu_dev, b, metas[i])) {
                chosen[i] = b;
                break;
            }
        }
    }

    // One context + buffer per buffer type.
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    for (size_t i = 0; i < req.size(); ++i) {
        if (!metas[i] || ctx_of.count(chosen[i])) continue;
        size_t n = 0;
        for (size_t j = 0; j < req.size(); ++j) n += (metas[j] && chosen[j] == chosen[i]);
        ggml_init_params ip = { ggml_tensor_overhead() * (n + 1), nullptr, true };
        ggml_context * c = ggml_init(ip);
        if (!c) throw engine_failure("failed to create a ggml context for the weights");
        sw->ctxs.push_back(c);
        ctx_of[chosen[i]] = c;
    }
    std::vector<ggml_tensor *> tensors(req.size(), nullptr);
    for (size_t i = 0; i < req.size(); ++i) {
        if (!metas[i]) continue;
        ggml_tensor * t = ggml_dup_tensor(ctx_of[chosen[i]], metas[i]);
        ggml_set_name(t, req[i].name.c_str());
        tensors[i] = t;
        *req[i].dst = t;
    }
    for (auto & [buft, c] : ctx_of) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            throw engine_failure(std::string("failed to allocate the weight buffer (") + ggml_backend_buft_name(buft) + ")");
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        sw->buffers.push_back(buf);
    }

    // Read the data. Host buffers are filled in place; extra buffer types repack in set_tensor,
    // which wants the whole tensor at once, so those go through a scratch buffer.
    std::vector<uint8_t> scratch;
    for (size_t i = 0; i < req.size(); ++i) {
        ggml_tensor * t = tensors[i];
        if (!t) continue;
        const size_t nb = ggml_nbytes(t);
        if (chosen[i] == cpu_buft) {
            pread_all(fh.fd, t->data, nb, offsets[i], path, req[i].file_name);
        } else {
            scratch.resize(nb);
            pread_all(fh.fd, scratch.data(), nb, offsets[i], path, req[i].file_name);
            ggml_backend_tensor_set(t, scratch.data(), 0, nb);
            sw->n_repacked++;
        }
        sw->weight_bytes += nb;
    }
    return sw;
}

}  // namespace pipeinfer
