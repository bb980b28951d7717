#include "engine.h"

#include "errors.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <new>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

namespace pipeinfer {

namespace {

constexpr int64_t max_invariant_rows = 64;

// Graph nodes for a layer range. An invariant graph slices matmuls and attention by rows, which
// adds about 30 nodes per row per layer (see graph_builder.cpp).
size_t graph_size_for(size_t n_layers, int64_t invariant_rows = 0) {
    return std::max<size_t>(1024, (64 + 30 * (size_t) invariant_rows) * n_layers + 256 + 8 * (size_t) invariant_rows);
}

// While loading, keep ggml's debug/info lines (one "repack tensor ..." line per weight) out of the
// log, and pass warnings and errors on to whatever logger was installed (llama_cpp's, if loaded).
class quiet_ggml_log {
public:
    quiet_ggml_log() {
        ggml_log_get(&prev_cb_, &prev_ud_);
        ggml_log_set(&quiet_ggml_log::filter, this);
    }
    ~quiet_ggml_log() { ggml_log_set(prev_cb_, prev_ud_); }

private:
    static void filter(ggml_log_level level, const char * text, void * ud) {
        auto * self = (quiet_ggml_log *) ud;
        if ((level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) && self->prev_cb_) {
            self->prev_cb_(level, text, self->prev_ud_);
        }
    }
    ggml_log_callback prev_cb_ = nullptr;
    void * prev_ud_ = nullptr;
};

}  // namespace

layer_engine::layer_engine(const engine_params & params) : params_(params) {
    if (params.n_ctx < 1) {
        throw invalid_input("n_ctx must be >= 1 (got " + std::to_string(params.n_ctx) + ")");
    }
    if (params.n_threads < 1) {
        throw invalid_input("n_threads must be >= 1 (got " + std::to_string(params.n_threads) + ")");
    }
    if (params.n_seq_max < 1 || params.n_seq_max > kv_max_seq) {
        throw invalid_input("n_seq_max must be in [1, " + std::to_string(kv_max_seq) + "] (got " +
                            std::to_string(params.n_seq_max) + ")");
    }
    {
        // The ggml logger is process-global: one load at a time swaps it, or two loads in
        // parallel threads could restore each other's (then dangling) filter.
        static std::mutex load_mutex;
        std::lock_guard<std::mutex> lock(load_mutex);
        quiet_ggml_log quiet;
        w_ = stage_weights_load(params.path, params.layer_begin, params.layer_end, params.use_repack);
    }
    try {
        kv_ = std::make_unique<kv_cache>(params.n_ctx, params.n_seq_max, (int) w_->layers.size(),
                                         (int64_t) w_->hparams.n_embd_gqa(), /*v_trans=*/ !params.flash_attn);
    } catch (const std::bad_alloc &) {
        const double gib = 2.0 * 2.0 * params.n_ctx * w_->hparams.n_embd_gqa() * w_->layers.size() / (1u << 30);
        char msg[256];
        std::snprintf(msg, sizeof(msg), "cannot allocate a KV cache of n_ctx=%u cells (%.1f GiB for K and V); "
                      "open the engine with a smaller n_ctx", params.n_ctx, gib);
        throw engine_failure(msg);
    }

    backend_ = ggml_backend_cpu_init();
    if (!backend_) throw engine_failure("ggml_backend_cpu_init failed");
    ggml_backend_cpu_set_n_threads(backend_, params.n_threads);
    ggml_backend_cpu_set_abort_callback(backend_, &layer_engine::abort_cb, this);

    galloc_ = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    if (!galloc_) throw engine_failure("ggml_gallocr_new failed");
    const size_t gs = graph_size_for(w_->layers.size());
    graph_meta_.resize(ggml_tensor_overhead() * gs + ggml_graph_overhead_custom(gs, false));
}

layer_engine::~layer_engine() {
    graph_drop();
    if (galloc_) ggml_gallocr_free(galloc_);
    if (backend_) ggml_backend_free(backend_);
}

void layer_engine::graph_drop() {
    if (graph_.ctx) ggml_free(graph_.ctx);
    graph_ = cached_graph{};
}

layer_engine::cached_graph & layer_engine::graph_for(const graph_shape & shape) {
    if (graph_.ctx && graph_.shape == shape) return graph_;
    graph_drop();
    const size_t gs = graph_size_for(w_->layers.size(), shape.invariant ? shape.n_tokens * (shape.ordered ? 2 : 1) : 0);
    const size_t meta = ggml_tensor_overhead() * gs + ggml_graph_overhead_custom(gs, false);
    if (graph_meta_.size() < meta) graph_meta_.resize(meta);
    ggml_init_params ip = { graph_meta_.size(), graph_meta_.data(), true };
    graph_.ctx = ggml_init(ip);
    if (!graph_.ctx) throw engine_failure("failed to create the graph context");
    try {
        graph_.gf = ggml_new_graph_custom(graph_.ctx, gs, false);
        graph_.res = graph_build(graph_.ctx, graph_.gf, *w_, *kv_, shape, graph_.in, progress_);
        if (!ggml_gallocr_alloc_graph(galloc_, graph_.gf)) throw engine_failure("failed to allocate the compute graph");
    } catch (...) {
        graph_drop();
        throw;
    }
    graph_.shape = shape;
    return graph_;
}

bool layer_engine::abort_cb(void * data) {
    return ((layer_engine *) data)->cancel_.load(std::memory_order_relaxed);
}

void layer_engine::validate(const eval_batch & b) const {
    const model_hparams & hp = w_->hparams;
    if (b.n_tokens < 1) throw invalid_input("eval needs at least one token (got an empty batch)");
    if (b.n_tokens > (int64_t) kv_->size()) {
        throw kv_cache_full("batch of " + std::to_string(b.n_tokens) + " tokens is larger than the KV cache (n_ctx=" +
                            std::to_string(kv_->size()) + "); split it or open the engine with a larger n_ctx");
    }
    if (is_first()) {
        if (!b.tokens || b.embd) {
            throw invalid_input("this stage holds layer 0: pass tokens=, not embd=");
        }
        for (int64_t i = 0; i < b.n_tokens; ++i) {
            if (b.tokens[i] < 0 || (uint32_t) b.tokens[i] >= hp.n_vocab) {
                throw invalid_input("token id " + std::to_string(b.tokens[i]) + " at row " + std::to_string(i) +
                                    " is out of range [0, n_vocab=" + std::to_string(hp.n_vocab) + ")");
            }
        }
    } else if (!b.embd || b.tokens) {
        throw invalid_input("this stage starts at layer " + std::to_string(w_->layer_begin) +
                            ": pass embd= (hidden states of the previous stage), not tokens=");
    }
    if (!b.pos) throw invalid_input("pos is required");
    if ((int64_t) b.seqs.size() != b.n_tokens) {
        throw invalid_input("seq_ids has " + std::to_string(b.seqs.size()) + " entries, expected one per token (" +
                            std::to_string(b.n_tokens) + ")");
    }
    const uint64_t allowed = kv_->n_seq_max() >= 64 ? ~0ull : ((1ull << kv_->n_seq_max()) - 1);
    for (int64_t i = 0; i < b.n_tokens; ++i) {
        if (b.pos[i] < 0) {
            throw invalid_input("position " + std::to_string(b.pos[i]) + " at row " + std::to_string(i) + " is negative");
        }
        if (b.seqs[i] == 0) throw invalid_input("row " + std::to_string(i) + " has no sequence id");
        if (b.seqs[i] & ~allowed) {
            throw invalid_input("row " + std::to_string(i) + " has a sequence id >= n_seq_max=" +
                                std::to_string(kv_->n_seq_max()));
        }
    }
    if (is_last()) {
        // No output rows is valid (a prompt chunk before the last): the batch only fills the
        // KV cache, and the graph stops after the last layer's K/V store.
        for (size_t i = 0; i < b.out_rows.size(); ++i) {
            if (b.out_rows[i] < 0 || b.out_rows[i] >= b.n_tokens || (i > 0 && b.out_rows[i] <= b.out_rows[i - 1])) {
                throw invalid_input("output rows must be distinct, ascending and < n_tokens");
            }
        }
    }
}

int64_t layer_engine::out_rows(const eval_batch & b) const {
    return is_last() ? (int64_t) b.out_rows.size() : b.n_tokens;
}

int64_t layer_engine::out_cols() const {
    return is_last() ? w_->hparams.n_vocab : w_->hparams.n_embd;
}

void layer_engine::eval(const eval_batch & b, float * out) {
    validate(b);
    std::lock_guard<std::mutex> lock(mutex_);
    const int n_range = (int) w_->layers.size();
    progress_.layers_done.store(0);
    {
        std::lock_guard<std::mutex> sl(stats_mutex_);
        stats_.evals++;
    }
    if (cancel_.load()) {
        std::lock_guard<std::mutex> sl(stats_mutex_);
        stats_.evals_cancelled++;
        stats_.layer_evals_skipped += n_range;
        throw eval_cancelled("eval cancelled before it started");
    }

    std::vector<kv_token> toks(b.n_tokens);
    for (int64_t i = 0; i < b.n_tokens; ++i) toks[i] = kv_token{b.pos[i], b.seqs[i]};
    const std::vector<uint32_t> cells = kv_->claim(toks);  // throws kv_cache_full, cache unchanged

    int layers_done = 0;
    bool computed = false;
    try {
        graph_shape shape;
        shape.n_tokens = b.n_tokens;
        shape.n_kv = kv_->n_kv();
        shape.n_outputs = out_rows(b);
        // Row slicing is for verification-sized batches; a prompt-sized batch would explode the graph.
        shape.invariant = b.invariant && b.n_tokens <= max_invariant_rows;
        // Cells out of plain decoding's layout (token trees): gather them in position order.
        std::vector<int32_t> order;
        shape.ordered = shape.invariant && kv_->v_trans() && kv_->position_order(shape.n_kv, toks, order);

        cached_graph & g = graph_for(shape);
        ggml_cgraph * gf = g.gf;
        const graph_inputs & in = g.in;
        ggml_tensor * res = g.res;

        // inputs (the gallocr buffer is host memory)
        const model_hparams & hp = w_->hparams;
        if (in.tokens) std::memcpy(in.tokens->data, b.tokens, sizeof(int32_t) * b.n_tokens);
        if (in.embd) std::memcpy(in.embd->data, b.embd, sizeof(float) * b.n_tokens * hp.n_embd);
        std::memcpy(in.pos->data, b.pos, sizeof(int32_t) * b.n_tokens);
        if (shape.ordered) {
            // Mask, scores and V rows indexed by position (see attention_ordered).
            const int64_t n_kv = shape.n_kv, n_head = hp.n_head, n_embd_gqa = hp.n_embd_gqa();
            auto * mask = (float *) in.kq_mask->data;
            auto * ko = (int32_t *) in.kq_order->data;
            auto * vo = (int32_t *) in.v_order->data;
            for (int64_t t = 0; t < b.n_tokens; ++t) {
                const int32_t * row = order.data() + t * n_kv;
                for (int64_t p = 0; p < n_kv; ++p) mask[t * n_kv + p] = row[p] >= 0 ? 0.0f : -INFINITY;
                for (int64_t h = 0; h < n_head; ++h) {
                    int32_t * dst = ko + (t * n_head + h) * n_kv;
                    for (int64_t p = 0; p < n_kv; ++p) dst[p] = std::max(row[p], 0);
                }
                for (int64_t c = 0; c < n_embd_gqa; ++c) {
                    int32_t * dst = vo + (t * n_embd_gqa + c) * n_kv;
                    for (int64_t p = 0; p < n_kv; ++p) dst[p] = std::max(row[p], 0);
                }
            }
        } else if (kv_->v_trans()) {
            kv_->fill_mask((float *) in.kq_mask->data, shape.n_kv, toks);
        } else {
            kv_->fill_mask_f16((ggml_fp16_t *) in.kq_mask->data, shape.n_kv, toks);
        }
        auto * k_idxs = (int64_t *) in.k_idxs->data;
        auto * v_idxs = (int64_t *) in.v_idxs->data;
        const int64_t n_embd_gqa = hp.n_embd_gqa(), kv_size = kv_->size();
        for (int64_t i = 0; i < b.n_tokens; ++i) {
            k_idxs[i] = cells[i];
            if (kv_->v_trans()) {
                // transposed V: channel c of the token in cell j is element c*kv_size + j
                for (int64_t c = 0; c < n_embd_gqa; ++c) v_idxs[i * n_embd_gqa + c] = c * kv_size + cells[i];
            } else {
                v_idxs[i] = cells[i];
            }
        }
        if (in.out_ids) std::memcpy(in.out_ids->data, b.out_rows.data(), sizeof(int32_t) * b.out_rows.size());

        computed = true;
        const auto t0 = std::chrono::steady_clock::now();
        const ggml_status st = ggml_backend_graph_compute(backend_, gf);
        const int64_t dt_us =
            std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
        layers_done = progress_.layers_done.load();
        {
            std::lock_guard<std::mutex> sl(stats_mutex_);
            stats_.t_compute_us += dt_us;
        }
        if (st == GGML_STATUS_ABORTED) {
            throw eval_cancelled("eval cancelled during compute after " + std::to_string(layers_done) + " of " +
                                 std::to_string(n_range) + " layers");
        }
        if (st != GGML_STATUS_SUCCESS) {
            throw engine_failure(std::string("ggml graph compute failed: ") + ggml_status_to_string(st));
        }
        if (res) std::memcpy(out, res->data, ggml_nbytes(res));
        std::lock_guard<std::mutex> sl(stats_mutex_);
        stats_.layer_evals += n_range;
    } catch (const eval_cancelled &) {
        kv_->release(cells);
        std::lock_guard<std::mutex> sl(stats_mutex_);
        stats_.evals_cancelled++;
        if (computed) stats_.cancelled_mid_compute++;
        stats_.layer_evals += layers_done;
        stats_.layer_evals_skipped += n_range - layers_done;
        throw;
    } catch (...) {
        kv_->release(cells);
        throw;
    }
}

bool layer_engine::seq_rm(int32_t seq_id, int32_t p0, int32_t p1) {
    std::lock_guard<std::mutex> lock(mutex_);
    return kv_->seq_rm(seq_id, p0, p1);
}
void layer_engine::seq_cp(int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    std::lock_guard<std::mutex> lock(mutex_);
    kv_->seq_cp(src, dst, p0, p1);
}
void layer_engine::seq_cp_many(int32_t src, const std::vector<int32_t> & dsts, int32_t p0, int32_t p1) {
    std::lock_guard<std::mutex> lock(mutex_);
    kv_->seq_cp_many(src, dsts, p0, p1);
}
void layer_engine::seq_keep(int32_t seq_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    kv_->seq_keep(seq_id);
}
int32_t layer_engine::seq_pos_max(int32_t seq_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return kv_->seq_pos_max(seq_id);
}
int32_t layer_engine::seq_pos_min(int32_t seq_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return kv_->seq_pos_min(seq_id);
}
void layer_engine::kv_clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    kv_->clear();
}
uint32_t layer_engine::kv_used_cells() {
    std::lock_guard<std::mutex> lock(mutex_);
    return kv_->n_used();
}
engine_stats layer_engine::stats() {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    return stats_;
}

}  // namespace pipeinfer
