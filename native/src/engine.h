// layer_engine: one stage of the pipeline. Owns the stage's weights, its KV cache, a CPU backend
// and a graph allocator reused across evals, and runs eval() for a batch of tokens.
#pragma once

#include "graph_builder.h"
#include "kv_cache.h"
#include "model_loader.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pipeinfer {

struct engine_params {
    std::string path;          // GGUF file
    int layer_begin = 0;       // first layer of the range
    int layer_end   = 0;       // one past the last layer
    int64_t n_ctx     = 4096;  // KV cache cells, in [1, 2^32)
    int     n_threads = 1;     // ggml compute threads, >= 1
    int64_t n_seq_max = 64;    // sequence ids are in [0, n_seq_max); n_seq_max in [1, kv_max_seq]
    int64_t n_slots = 1;       // KV slots (parallel requests), each n_ctx/n_slots cells and n_seq_max/n_slots
                               // sequence ids; dividing both (see kv_cache)
    bool use_repack = true;    // place matrix weights in the CPU extra buffer types (CPU_REPACK)
    bool swa_full = false;     // sliding-window layers keep every cell (as llama.cpp's --swa-full); also
                               // with PIPEINFER_SWA_FULL=1. Otherwise they keep a window cache.
    bool flash_attn = false;   // ggml_flash_attn_ext instead of mul_mat + soft_max (llama.cpp's
                               // default is off, and parity with it is exact only when off)
};

// Counters since open; names match the Python stats() dict.
struct engine_stats {
    uint64_t evals = 0;                  // eval calls that passed validation
    uint64_t evals_cancelled = 0;        // evals that ended with eval_cancelled
    uint64_t cancelled_mid_compute = 0;  // ... of which had already started computing
    uint64_t layer_evals = 0;            // layers computed (summed over evals)
    uint64_t layer_evals_skipped = 0;    // layers not computed because of a cancel
    int64_t  t_compute_us = 0;           // wall time spent in graph compute
};

// A borrowed array and its shape, as the caller gave it; validate() checks rank and length.
template <typename T>
struct array_view {
    const T * data = nullptr;    // null: the argument was not given
    std::vector<int64_t> shape;  // row-major, C-contiguous
    bool given() const { return data != nullptr; }
};

// One eval's input, borrowed from the caller, unchecked (like llama_batch before llama_decode).
struct eval_batch {
    array_view<int32_t> tokens;   // (n,) token ids; the first stage only
    array_view<float>   embd;     // (n, n_embd) hidden states of the previous stage; later stages
    array_view<int32_t> pos;      // (n,) position of each token
    std::vector<int32_t> n_seq_id;  // (n,) number of sequence ids of each token
    std::vector<int64_t> seq_id;    // the ids of token 0, then token 1, ... (sum of n_seq_id)
    array_view<bool>    output;   // (n,) rows whose logits the last stage returns; not given: last row
    bool invariant = false;       // compute every row exactly as in a one-token batch
};

// A batch that passed layer_engine::validate: sizes agree, ids are in range. Only validate makes one.
struct checked_batch {
    int64_t n_tokens = 0;
    const int32_t * tokens = nullptr;    // [n_tokens] (first stage)
    const float   * embd   = nullptr;    // [n_tokens, n_embd] (later stages)
    const int32_t * pos    = nullptr;    // [n_tokens]
    std::vector<uint64_t> seqs;          // [n_tokens] sequence sets as bit masks
    std::vector<int32_t> out_rows;       // rows whose logits the last stage returns, ascending
    bool invariant = false;
private:
    checked_batch() = default;
    friend class layer_engine;
};

class layer_engine {
public:
    explicit layer_engine(const engine_params & params);
    ~layer_engine();

    const model_hparams & hparams() const { return w_->hparams; }
    const stage_weights & weights() const { return *w_; }
    const engine_params & params() const { return params_; }
    bool is_first() const { return w_->is_first(); }
    bool is_last() const { return w_->is_last(); }

    // Evaluating a batch is two calls, so that the caller can size the output between them:
    //   checked_batch cb = eng.validate(batch);           // every input check, once
    //   std::vector<float> out(eng.out_rows(cb) * eng.out_cols());
    //   eng.eval(cb, out.data());
    //
    // validate() throws, naming the bad value and the expected range:
    //   invalid_input  neither or both of tokens/embd, or the wrong one for this stage (tokens on
    //                  the first stage, embd on later ones); an array of the wrong rank; embd not
    //                  (n, n_embd); pos, seq ids or output of another length than n; an empty batch;
    //                  a token id outside [0, n_vocab); a negative position; a row without sequence
    //                  ids; a sequence id outside [0, n_seq_max).
    //   kv_cache_full  the batch has more tokens than the cache has cells (it can never fit).
    // The cache is not touched. The checks depend only on the engine's fixed parameters, so a
    // checked_batch stays valid for the engine that made it.
    checked_batch validate(const eval_batch & b) const;
    // Rows and columns eval writes: (n_tokens, n_embd), or (n_outputs, n_vocab) on the last stage.
    int64_t out_rows(const checked_batch & b) const;
    int64_t out_cols() const;
    // Runs the batch; writes out_rows(b) x out_cols() floats to out. Throws:
    //   kv_cache_full   not enough free cells now (cache unchanged);
    //   eval_cancelled  cancel() was set before or during the compute (the claimed cells are freed,
    //                   so the cache is as before the call);
    //   engine_failure  ggml could not allocate or compute the graph (cells freed as well).
    void eval(const checked_batch & b, float * out);

    void cancel() { cancel_.store(true); }
    void clear_cancel() { cancel_.store(false); }
    bool cancel_requested() const { return cancel_.load(); }

    // KV cache operations, serialized with eval.
    void seq_rm(int32_t seq_id, int32_t p0, int32_t p1);
    void seq_cp(int32_t src, int32_t dst, int32_t p0, int32_t p1);
    void seq_cp_many(int32_t src, const std::vector<int32_t> & dsts, int32_t p0, int32_t p1);
    void seq_keep(int32_t seq_id);
    int32_t seq_pos_max(int32_t seq_id);
    int32_t seq_pos_min(int32_t seq_id);
    void kv_clear();
    uint32_t kv_used_cells();
    size_t kv_bytes() const { return kv_->bytes() + (kv_swa_ ? kv_swa_->bytes() : 0); }
    // Cells of the sliding-window layers' own cache (0: none, they share the full cache) and in use.
    uint32_t kv_swa_size() const { return kv_swa_ ? kv_swa_->size() : 0; }
    uint32_t kv_swa_used_cells();
    // The smallest position seq_id can be continued from (after a seq_rm of its tail): the window
    // cache has pruned the cells before (kv_cache::window_floor); 0 when nothing was pruned.
    int32_t kv_min_resume(int32_t seq_id);

    engine_stats stats();
    // Layers of the current (or last) eval that have finished; lock-free, for progress and tests.
    int eval_progress() const { return progress_.layers_done.load(std::memory_order_relaxed); }

private:
    static bool abort_cb(void * data);

    engine_params params_;
    std::unique_ptr<stage_weights> w_;
    std::unique_ptr<kv_cache> kv_;
    std::unique_ptr<kv_cache> kv_swa_;  // the sliding-window layers' window cache (null: in kv_)
    ggml_backend_t backend_ = nullptr;
    ggml_gallocr_t galloc_ = nullptr;
    // The last graph, kept allocated: a decode step has the same shape as the previous one
    // (1 token, n_kv padded to 256), so it only needs new input data, like llama.cpp's graph reuse.
    struct cached_graph {
        ggml_context * ctx = nullptr;  // no_alloc context in graph_meta_
        ggml_cgraph  * gf  = nullptr;
        graph_inputs   in;
        ggml_tensor  * res = nullptr;  // output tensor
        graph_shape    shape;
    };
    cached_graph & graph_for(const graph_shape & shape);
    void graph_drop();
    // Sections of eval.
    void check_embd_or_tokens(const eval_batch & b, checked_batch & cb) const;
    void check_rows(const eval_batch & b, checked_batch & cb) const;
    void open_caches();
    graph_shape shape_for(const checked_batch & b, const std::vector<kv_token> & toks, std::vector<int32_t> & order,
                          std::vector<int32_t> & swa_rows) const;
    void plan_window(const std::vector<kv_token> & toks, graph_shape & shape, std::vector<int32_t> & swa_rows) const;
    void set_inputs(const cached_graph & g, const checked_batch & b, const std::vector<kv_token> & toks,
                    const std::vector<uint32_t> & cells, const std::vector<int32_t> & order) const;
    void set_window_inputs(const cached_graph & g, const std::vector<kv_token> & toks,
                           const std::vector<uint32_t> & swa_cells, const std::vector<int32_t> & swa_rows) const;
    void fill_kq_mask(ggml_tensor * mask, const graph_shape & shape, const std::vector<kv_token> & toks,
                      const std::vector<int32_t> & order, uint32_t n_swa) const;
    void compute(const cached_graph & g, float * out, int & layers_done);
    void count_cancel(bool computed, int layers_done);

    std::vector<uint8_t> graph_meta_;  // memory of the graph context (tensor and graph metadata)
    cached_graph graph_;
    layer_progress progress_;
    std::atomic<bool> cancel_{false};
    std::mutex mutex_;                 // one eval or cache op at a time
    std::mutex stats_mutex_;           // guards stats_ only, so stats() does not wait for an eval
    engine_stats stats_;
};

}  // namespace pipeinfer
