#include "engine.h"

#include "cpu_backend.h"
#include "errors.h"
#include "gguf_file.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <new>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace pipeinfer {

namespace {

constexpr int64_t max_invariant_rows = 64;

// Graph nodes for a layer range. An invariant graph slices matmuls and attention by rows, which
// adds about 30 nodes per row per layer (see graph_builder.cpp). A mixture-of-experts FFN adds its
// router and expert ops, two per routed expert, and up to 16 per row when sliced (ffn_moe.cpp).
size_t graph_size_for(const model_hparams & hp, size_t n_layers, int64_t invariant_rows = 0) {
    const size_t per_layer = 64 + (hp.n_expert ? 32 + 2 * (size_t) hp.n_expert_used : 0);
    const size_t per_row = 30 + (hp.n_expert ? 16 : 0);
    return std::max<size_t>(1024, (per_layer + per_row * (size_t) invariant_rows) * n_layers + 256 +
                                  8 * (size_t) invariant_rows);
}

// "(2, 63)", "(64,)": a shape as numpy prints it.
std::string shape_str(const std::vector<int64_t> & shape) {
    std::string s = "(";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + (shape.size() == 1 ? ",)" : ")");
}

// A 1-D argument with one entry per token.
template <typename T>
void check_per_token(const array_view<T> & a, const char * name, int64_t n_tokens) {
    if (a.shape.size() != 1) {
        throw invalid_input(std::string(name) + " must be 1-D, got shape " + shape_str(a.shape));
    }
    if (a.shape[0] != n_tokens) {
        throw invalid_input(std::string(name) + " has " + std::to_string(a.shape[0]) + " entries, expected n_tokens=" +
                            std::to_string(n_tokens));
    }
}

// Attention inputs of an ordered graph: scores and V rows indexed by position (see attention_ordered
// in graph_builder.cpp). order[t*n_kv + p] is the cell at position p, or -1.
// The scores are a view of the slot (indices from its first cell); V rows index the whole cache.
void fill_ordered(const graph_inputs & in, const model_hparams & hp, int64_t n_tokens, int64_t n_kv, int64_t base,
                  const std::vector<int32_t> & order) {
    const int64_t n_head = hp.n_head, n_embd_gqa = hp.n_embd_gqa();
    auto * ko = (int32_t *) in.kq_order->data;
    auto * vo = (int32_t *) in.v_order->data;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = order.data() + t * n_kv;
        for (int64_t h = 0; h < n_head; ++h) {
            int32_t * dst = ko + (t * n_head + h) * n_kv;
            for (int64_t p = 0; p < n_kv; ++p) dst[p] = std::max(row[p], 0);
        }
        for (int64_t c = 0; c < n_embd_gqa; ++c) {
            int32_t * dst = vo + (t * n_embd_gqa + c) * n_kv;
            for (int64_t p = 0; p < n_kv; ++p) dst[p] = (int32_t) base + std::max(row[p], 0);
        }
    }
}

// The mask of an ordered graph, indexed by position: position p is visible to token t when a cell
// holds it and, with a sliding window n_swa > 0, pos_t - p < n_swa.
void fill_ordered_mask(float * mask, const std::vector<kv_token> & toks, int64_t n_kv,
                       const std::vector<int32_t> & order, uint32_t n_swa) {
    for (size_t t = 0; t < toks.size(); ++t) {
        const int32_t * row = order.data() + t * n_kv;
        for (int64_t p = 0; p < n_kv; ++p) {
            const bool in_window = n_swa == 0 || toks[t].pos - p < (int64_t) n_swa;
            mask[t * n_kv + p] = row[p] >= 0 && in_window ? 0.0f : -INFINITY;
        }
    }
}

}  // namespace

layer_engine::layer_engine(const engine_params & params) : params_(params) {
    if (params.n_ctx < 1 || params.n_ctx > (int64_t) UINT32_MAX) {
        throw invalid_input("n_ctx must be in [1, " + std::to_string(UINT32_MAX) + "] (got " +
                            std::to_string(params.n_ctx) + ")");
    }
    if (params.n_threads < 1) {
        throw invalid_input("n_threads must be >= 1 (got " + std::to_string(params.n_threads) + ")");
    }
    if (params.n_seq_max < 1 || params.n_seq_max > (int64_t) kv_max_seq) {
        throw invalid_input("n_seq_max must be in [1, " + std::to_string(kv_max_seq) + "] (got " +
                            std::to_string(params.n_seq_max) + ")");
    }
    if (params.n_slots < 1 || params.n_ctx % params.n_slots != 0 || params.n_seq_max % params.n_slots != 0) {
        throw invalid_input("n_slots must be >= 1 and divide n_ctx and n_seq_max (got n_slots=" +
                            std::to_string(params.n_slots) + ", n_ctx=" + std::to_string(params.n_ctx) +
                            ", n_seq_max=" + std::to_string(params.n_seq_max) + ")");
    }
    {
        // Keeps the "repack tensor ..." lines out of the log; one load (or header read) at a time.
        quiet_ggml_log quiet;
        w_ = stage_weights_load(params.path, params.layer_begin, params.layer_end, params.use_repack);
    }
    open_caches();

    backend_ = cpu_backend_new(params.n_threads, &layer_engine::abort_cb, this);

    galloc_ = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    if (!galloc_) throw engine_failure("ggml_gallocr_new failed");
    const size_t gs = graph_size_for(w_->hparams, w_->layers.size());
    graph_meta_.resize(ggml_tensor_overhead() * gs + ggml_graph_overhead_custom(gs, false));
}

// The full cache, and for sliding-window layers a cache of their window: n_swa + 512 cells
// (llama.cpp sizes its SWA cache n_swa * n_seq + a ubatch), room for a 256-token prompt chunk and
// for rollbacks (rejected drafts, cancelled runs) of the newest positions. The window cache trades
// speed for memory (each local layer gathers its window in position order for every batch, so
// that attention sums exactly as over the full cache), so it is used where the memory matters: when
// the full cache's local layers would hold at least SWA_WINDOW_FACTOR times the window cache.
// PIPEINFER_SWA_FULL=1 (or swa_full) always keeps the full cache, PIPEINFER_SWA_FULL=0 always the window.
void layer_engine::open_caches() {
    const model_hparams & hp = w_->hparams;
    const size_t n_local = w_->layers.size();
    std::vector<bool> swa(n_local), full(n_local, true);
    const char * env = std::getenv("PIPEINFER_SWA_FULL");
    const std::string choice = env ? env : "";
    const bool swa_full = params_.swa_full || choice == "1";
    const uint32_t pad = 256, want = (hp.n_swa + 512 + pad - 1) / pad * pad;
    constexpr int64_t SWA_WINDOW_FACTOR = 8;
    const bool worth_it = choice == "0" || params_.n_ctx >= SWA_WINDOW_FACTOR * (int64_t) want;
    // KV slots (parallel requests) keep the full cache: the window cache has no slots.
    const bool window = hp.n_swa > 0 && !swa_full && want < params_.n_ctx && worth_it && params_.n_slots == 1;
    size_t n_swa_layers = 0;
    for (size_t li = 0; li < n_local; ++li) {
        swa[li] = window && hp.is_swa(w_->layer_begin + (int) li);
        full[li] = !swa[li];
        n_swa_layers += swa[li];
    }
    try {
        kv_ = std::make_unique<kv_cache>((uint32_t) params_.n_ctx, (uint32_t) params_.n_seq_max, full,
                                         (int64_t) hp.n_embd_gqa(), /*v_trans=*/ !params_.flash_attn, 0,
                                         (uint32_t) params_.n_slots);
        if (n_swa_layers > 0) {
            kv_swa_ = std::make_unique<kv_cache>(want, (uint32_t) params_.n_seq_max, swa, (int64_t) hp.n_embd_gqa(),
                                                 /*v_trans=*/ false, hp.n_swa);
        }
    } catch (const std::bad_alloc &) {
        // K and V, f16, per cell and layer; decimal GB, as the rest of the tool reports sizes.
        const double cells = (double) params_.n_ctx * (n_local - n_swa_layers) + (double) want * n_swa_layers;
        const double gb = 2.0 * 2.0 * cells * hp.n_embd_gqa() / 1e9;
        char msg[256];
        std::snprintf(msg, sizeof(msg), "cannot allocate a KV cache of %lld cells: it needs %.1f GB for K and V",
                      (long long) params_.n_ctx, gb);
        throw engine_failure(msg);
    }
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
    const int64_t rows = (shape.invariant ? shape.n_tokens * (shape.ordered ? 2 : 1) : 0) +
                         (shape.swa_groups > 1 ? shape.swa_groups : 0);  // a window view per token
    const size_t gs = graph_size_for(w_->hparams, w_->layers.size(), rows);
    const size_t meta = ggml_tensor_overhead() * gs + ggml_graph_overhead_custom(gs, false);
    if (graph_meta_.size() < meta) graph_meta_.resize(meta);
    ggml_init_params ip = { graph_meta_.size(), graph_meta_.data(), true };
    graph_.ctx = ggml_init(ip);
    if (!graph_.ctx) throw engine_failure("failed to create the graph context");
    try {
        graph_.gf = ggml_new_graph_custom(graph_.ctx, gs, false);
        graph_.res = graph_build(graph_.ctx, graph_.gf, *w_, *kv_, kv_swa_.get(), shape, graph_.in, progress_);
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

// tokens= on the first stage (ids in [0, n_vocab)), embd= (n, n_embd) on the others; sets n_tokens.
void layer_engine::check_embd_or_tokens(const eval_batch & b, checked_batch & cb) const {
    const model_hparams & hp = w_->hparams;
    if (b.tokens.given() && b.embd.given()) throw invalid_input("pass either tokens= or embd=, not both");
    if (!b.tokens.given() && !b.embd.given()) {
        throw invalid_input("eval needs tokens= (first stage) or embd= (later stages)");
    }
    if (is_first() && !b.tokens.given()) throw invalid_input("this stage holds layer 0: pass tokens=, not embd=");
    if (!is_first() && !b.embd.given()) {
        throw invalid_input("this stage starts at layer " + std::to_string(w_->layer_begin) +
                            ": pass embd= (hidden states of the previous stage), not tokens=");
    }
    if (b.embd.given()) {
        if (b.embd.shape.size() != 2 || b.embd.shape[1] != (int64_t) hp.n_embd) {
            throw invalid_input("embd must have shape (n_tokens, " + std::to_string(hp.n_embd) + ") (n_embd=" +
                                std::to_string(hp.n_embd) + "), got " + shape_str(b.embd.shape));
        }
        cb.n_tokens = b.embd.shape[0];
        cb.embd = b.embd.data;
        return;
    }
    if (b.tokens.shape.size() != 1) {
        throw invalid_input("tokens must be 1-D, got shape " + shape_str(b.tokens.shape));
    }
    cb.n_tokens = b.tokens.shape[0];
    cb.tokens = b.tokens.data;
    for (int64_t i = 0; i < cb.n_tokens; ++i) {
        if (cb.tokens[i] < 0 || (uint32_t) cb.tokens[i] >= hp.n_vocab) {
            throw invalid_input("token id " + std::to_string(cb.tokens[i]) + " at row " + std::to_string(i) +
                                " is out of range [0, n_vocab=" + std::to_string(hp.n_vocab) + ")");
        }
    }
}

// pos (non-negative), sequence ids (each row a non-empty set in [0, n_seq_max)) and output flags.
void layer_engine::check_rows(const eval_batch & b, checked_batch & cb) const {
    const int64_t n = cb.n_tokens;
    if (!b.pos.given()) throw invalid_input("pos is required");
    check_per_token(b.pos, "pos", n);
    cb.pos = b.pos.data;
    for (int64_t i = 0; i < n; ++i) {
        if (cb.pos[i] < 0) {
            throw invalid_input("position " + std::to_string(cb.pos[i]) + " at row " + std::to_string(i) + " is negative");
        }
    }
    if ((int64_t) b.n_seq_id.size() != n) {
        throw invalid_input("seq_ids has " + std::to_string(b.n_seq_id.size()) + " entries, expected n_tokens=" +
                            std::to_string(n));
    }
    const int64_t n_seq_max = kv_->n_seq_max();
    cb.seqs.assign(n, 0);
    size_t k = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (b.n_seq_id[i] < 1) throw invalid_input("row " + std::to_string(i) + " has an empty seq_ids list");
        for (int32_t j = 0; j < b.n_seq_id[i]; ++j, ++k) {
            const int64_t s = k < b.seq_id.size() ? b.seq_id[k] : -1;
            if (s < 0 || s >= n_seq_max) {
                throw invalid_input("seq id " + std::to_string(s) + " at row " + std::to_string(i) +
                                    " is out of range [0, n_seq_max=" + std::to_string(n_seq_max) + ")");
            }
            cb.seqs[i] |= 1ull << s;
        }
    }
    if (!is_last()) return;  // the other stages return every row
    if (!b.output.given()) {
        cb.out_rows = {(int32_t) (n - 1)};
        return;
    }
    // No output rows is valid (a prompt chunk before the last): the batch only fills the KV cache.
    check_per_token(b.output, "output", n);
    for (int64_t i = 0; i < n; ++i) {
        if (b.output.data[i]) cb.out_rows.push_back((int32_t) i);
    }
}

checked_batch layer_engine::validate(const eval_batch & b) const {
    checked_batch cb;
    cb.invariant = b.invariant;
    check_embd_or_tokens(b, cb);
    if (cb.n_tokens < 1) throw invalid_input("eval needs at least one token (got an empty batch)");
    if (cb.n_tokens > (int64_t) kv_->slot_size()) {
        throw kv_cache_full("batch of " + std::to_string(cb.n_tokens) + " tokens is larger than the KV cache (" +
                            std::to_string(kv_->slot_size()) + " cells" + (kv_->n_slots() > 1 ? " per slot" : "") +
                            "); split it or open the engine with a larger n_ctx");
    }
    check_rows(b, cb);
    return cb;
}

int64_t layer_engine::out_rows(const checked_batch & b) const {
    return is_last() ? (int64_t) b.out_rows.size() : b.n_tokens;
}

int64_t layer_engine::out_cols() const {
    return is_last() ? w_->hparams.n_vocab : w_->hparams.n_embd;
}

graph_shape layer_engine::shape_for(const checked_batch & b, const std::vector<kv_token> & toks,
                                    std::vector<int32_t> & order, std::vector<int32_t> & swa_rows) const {
    graph_shape shape;
    shape.n_tokens = b.n_tokens;
    const uint32_t slot = kv_->batch_slot(toks);
    shape.kv_base = kv_->slot_base(slot);
    shape.n_kv = kv_->n_kv(slot);
    shape.n_outputs = out_rows(b);
    // Row slicing is for verification-sized batches; a prompt-sized batch would explode the graph.
    shape.invariant = b.invariant && b.n_tokens <= max_invariant_rows;
    // Cells out of plain decoding's layout (token trees): gather them in position order.
    shape.ordered = shape.invariant && kv_->v_trans() && kv_->position_order(shape.kv_base, shape.n_kv, toks, order);
    if (kv_swa_) plan_window(toks, shape, swa_rows);
    return shape;
}

namespace {
// First position of a window view: the oldest position a token at pos may attend, rounded down to 256.
int32_t window_base(int32_t pos, uint32_t n_swa) { return std::max<int32_t>(0, pos - (int32_t) n_swa + 1) / 256 * 256; }
uint32_t round_256(int64_t n) { return (uint32_t) ((n + 255) / 256 * 256); }
}  // namespace

// The sliding-window views of the batch: one shared view when its cells have distinct positions,
// else one per token (token trees); see kv_cache::window_rows.
void layer_engine::plan_window(const std::vector<kv_token> & toks, graph_shape & shape,
                               std::vector<int32_t> & swa_rows) const {
    const uint32_t n_swa = kv_swa_->n_swa();
    int32_t pmin = toks[0].pos, pmax = toks[0].pos;
    for (const auto & t : toks) {
        pmin = std::min(pmin, t.pos);
        pmax = std::max(pmax, t.pos);
    }
    const int32_t base = window_base(pmin, n_swa);
    shape.swa_groups = 1;
    shape.n_kv_swa = round_256(pmax - base + 1);
    swa_rows.resize(shape.n_kv_swa);
    if (kv_swa_->window_rows(toks, 0, toks.size(), base, shape.n_kv_swa, swa_rows.data())) return;
    shape.swa_groups = (int64_t) toks.size();
    shape.n_kv_swa = 0;
    for (const auto & t : toks) shape.n_kv_swa = std::max(shape.n_kv_swa, round_256(t.pos - window_base(t.pos, n_swa) + 1));
    swa_rows.resize((size_t) shape.n_kv_swa * toks.size());
    for (size_t t = 0; t < toks.size(); ++t) {
        if (!kv_swa_->window_rows(toks, t, t + 1, window_base(toks[t].pos, n_swa), shape.n_kv_swa,
                                  swa_rows.data() + t * shape.n_kv_swa)) {
            throw invalid_input("two cells of the sliding-window cache hold position-sharing tokens of row " +
                                std::to_string(t) + "'s sequences");
        }
    }
}

// The sliding-window cache's inputs: the token rows, the views' cells and their mask.
void layer_engine::set_window_inputs(const cached_graph & g, const std::vector<kv_token> & toks,
                                     const std::vector<uint32_t> & swa_cells, const std::vector<int32_t> & swa_rows) const {
    const graph_inputs & in = g.in;
    const uint32_t n = g.shape.n_kv_swa;
    const size_t per_group = toks.size() / g.shape.swa_groups;
    auto * k_idxs = (int64_t *) in.k_idxs_swa->data;
    for (size_t i = 0; i < toks.size(); ++i) k_idxs[i] = swa_cells[i];
    auto * rows = (int32_t *) in.swa_rows->data;
    for (size_t j = 0; j < swa_rows.size(); ++j) rows[j] = std::max(swa_rows[j], 0);
    if (!in.kq_mask_swa->data) return;
    for (size_t t = 0; t < toks.size(); ++t) {
        const int32_t * view = swa_rows.data() + (t / per_group) * n;
        if (kv_->v_trans()) kv_swa_->fill_window_mask((float *) in.kq_mask_swa->data + t * n, view, n, toks[t]);
        else kv_swa_->fill_window_mask((ggml_fp16_t *) in.kq_mask_swa->data + t * n, view, n, toks[t]);
    }
}

// Writes the batch into the graph's input tensors (the gallocr buffer is host memory).
void layer_engine::set_inputs(const cached_graph & g, const checked_batch & b, const std::vector<kv_token> & toks,
                              const std::vector<uint32_t> & cells, const std::vector<int32_t> & order) const {
    const graph_inputs & in = g.in;
    const model_hparams & hp = w_->hparams;
    if (in.tokens) std::memcpy(in.tokens->data, b.tokens, sizeof(int32_t) * b.n_tokens);
    if (in.embd) std::memcpy(in.embd->data, b.embd, sizeof(float) * b.n_tokens * hp.n_embd);
    std::memcpy(in.pos->data, b.pos, sizeof(int32_t) * b.n_tokens);
    // An attention input nothing reads has no memory: a last stage of one layer with no rows to
    // output only stores K/V, and a stage without sliding-window (or without global) layers
    // leaves that mask unused.
    fill_kq_mask(in.kq_mask, g.shape, toks, order, 0);
    if (in.kq_mask_swa && !kv_swa_) fill_kq_mask(in.kq_mask_swa, g.shape, toks, order, hp.n_swa);
    if (g.shape.ordered && in.kq_order->data) fill_ordered(in, hp, b.n_tokens, g.shape.n_kv, g.shape.kv_base, order);
    if (in.out_ids) std::memcpy(in.out_ids->data, b.out_rows.data(), sizeof(int32_t) * b.out_rows.size());
    if (!in.k_idxs->data) return;  // every layer of the stage is a sliding-window layer (kv_swa_)
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
}

// One attention mask of the graph (n_swa > 0: a sliding-window layers' mask).
void layer_engine::fill_kq_mask(ggml_tensor * mask, const graph_shape & shape, const std::vector<kv_token> & toks,
                                const std::vector<int32_t> & order, uint32_t n_swa) const {
    if (!mask->data) return;
    if (shape.ordered) {
        fill_ordered_mask((float *) mask->data, toks, shape.n_kv, order, n_swa);
    } else if (kv_->v_trans()) {
        kv_->fill_mask((float *) mask->data, shape.kv_base, shape.n_kv, toks, n_swa);
    } else {
        kv_->fill_mask((ggml_fp16_t *) mask->data, shape.kv_base, shape.n_kv, toks, n_swa);
    }
}

// Runs the graph and copies its result to out; throws eval_cancelled / engine_failure.
void layer_engine::compute(const cached_graph & g, float * out, int & layers_done) {
    const int n_range = (int) w_->layers.size();
    const auto t0 = std::chrono::steady_clock::now();
    const ggml_status st = ggml_backend_graph_compute(backend_, g.gf);
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
    if (g.res) std::memcpy(out, g.res->data, ggml_nbytes(g.res));
    std::lock_guard<std::mutex> sl(stats_mutex_);
    stats_.layer_evals += n_range;
}

void layer_engine::count_cancel(bool computed, int layers_done) {
    const int n_range = (int) w_->layers.size();
    std::lock_guard<std::mutex> sl(stats_mutex_);
    stats_.evals_cancelled++;
    if (computed) stats_.cancelled_mid_compute++;
    stats_.layer_evals += layers_done;
    stats_.layer_evals_skipped += n_range - layers_done;
}

void layer_engine::eval(const checked_batch & b, float * out) {
    std::lock_guard<std::mutex> lock(mutex_);
    progress_.layers_done.store(0);
    {
        std::lock_guard<std::mutex> sl(stats_mutex_);
        stats_.evals++;
    }
    if (cancel_.load()) {
        count_cancel(false, 0);
        throw eval_cancelled("eval cancelled before it started");
    }

    std::vector<kv_token> toks(b.n_tokens);
    for (int64_t i = 0; i < b.n_tokens; ++i) toks[i] = kv_token{b.pos[i], b.seqs[i]};
    const std::vector<uint32_t> cells = kv_->claim(toks);  // throws kv_cache_full, cache unchanged
    std::vector<uint32_t> swa_cells;
    int layers_done = 0;
    bool computed = false;
    auto release = [&] {
        kv_->release(cells);
        if (kv_swa_) kv_swa_->release(swa_cells);  // pruned cells stay pruned: nobody could attend them
    };
    try {
        if (kv_swa_) swa_cells = kv_swa_->claim(toks);
        std::vector<int32_t> order, swa_rows;
        const cached_graph & g = graph_for(shape_for(b, toks, order, swa_rows));
        set_inputs(g, b, toks, cells, order);
        if (kv_swa_) set_window_inputs(g, toks, swa_cells, swa_rows);
        computed = true;
        compute(g, out, layers_done);
    } catch (const eval_cancelled &) {
        release();
        count_cancel(computed, layers_done);
        throw;
    } catch (...) {
        release();
        throw;
    }
}

void layer_engine::seq_rm(int32_t seq_id, int32_t p0, int32_t p1) {
    std::lock_guard<std::mutex> lock(mutex_);
    kv_->seq_rm(seq_id, p0, p1);
    if (kv_swa_) kv_swa_->seq_rm(seq_id, p0, p1);
}
void layer_engine::seq_cp(int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    std::lock_guard<std::mutex> lock(mutex_);
    kv_->seq_cp(src, dst, p0, p1);
    if (kv_swa_) kv_swa_->seq_cp(src, dst, p0, p1);
}
void layer_engine::seq_cp_many(int32_t src, const std::vector<int32_t> & dsts, int32_t p0, int32_t p1) {
    std::lock_guard<std::mutex> lock(mutex_);
    kv_->seq_cp_many(src, dsts, p0, p1);
    if (kv_swa_) kv_swa_->seq_cp_many(src, dsts, p0, p1);
}
void layer_engine::seq_keep(int32_t seq_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    kv_->seq_keep(seq_id);
    if (kv_swa_) kv_swa_->seq_keep(seq_id);
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
    if (kv_swa_) kv_swa_->clear();
}
int32_t layer_engine::kv_min_resume(int32_t seq_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!kv_swa_ || seq_id < 0 || seq_id >= (int32_t) kv_swa_->n_seq_max()) return 0;
    const int32_t floor = kv_swa_->window_floor(seq_id);
    return floor > 0 ? floor + (int32_t) kv_swa_->n_swa() - 1 : 0;
}
uint32_t layer_engine::kv_swa_used_cells() {
    std::lock_guard<std::mutex> lock(mutex_);
    return kv_swa_ ? kv_swa_->n_used() : 0;
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
