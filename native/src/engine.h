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
    uint32_t n_ctx     = 4096; // KV cache cells
    int      n_threads = 1;    // ggml compute threads
    uint32_t n_seq_max = 64;   // sequence ids are in [0, n_seq_max), at most kv_max_seq
    bool use_repack = true;    // place matrix weights in the CPU extra buffer types (CPU_REPACK)
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

// One eval's batch, borrowed from the caller. Exactly one of tokens/embd is set.
struct eval_batch {
    int64_t n_tokens = 0;
    const int32_t * tokens = nullptr;    // [n_tokens] token ids (first stage)
    const float   * embd   = nullptr;    // [n_tokens, n_embd] hidden states (later stages)
    const int32_t * pos    = nullptr;    // [n_tokens]
    std::vector<uint64_t> seqs;          // [n_tokens] sequence sets as bit masks
    std::vector<int32_t> out_rows;       // rows whose logits the last stage returns, ascending
    bool invariant = false;              // every row computed exactly as in a one-token batch
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

    // Checks a batch against the model and the cache; throws invalid_input naming the bad value.
    void validate(const eval_batch & b) const;
    // Rows and columns eval writes: (n_tokens, n_embd) or (n_outputs, n_vocab) on the last stage.
    int64_t out_rows(const eval_batch & b) const;
    int64_t out_cols() const;
    // Runs the batch; writes out_rows(b) x out_cols() floats to out. Throws eval_cancelled
    // (cache unchanged) if cancelled, kv_cache_full if the batch does not fit.
    void eval(const eval_batch & b, float * out);

    void cancel() { cancel_.store(true); }
    void clear_cancel() { cancel_.store(false); }
    bool cancel_requested() const { return cancel_.load(); }

    // KV cache operations, serialized with eval.
    bool seq_rm(int32_t seq_id, int32_t p0, int32_t p1);
    void seq_cp(int32_t src, int32_t dst, int32_t p0, int32_t p1);
    void seq_cp_many(int32_t src, const std::vector<int32_t> & dsts, int32_t p0, int32_t p1);
    void seq_keep(int32_t seq_id);
    int32_t seq_pos_max(int32_t seq_id);
    int32_t seq_pos_min(int32_t seq_id);
    void kv_clear();
    uint32_t kv_used_cells();
    size_t kv_bytes() const { return kv_->bytes(); }

    engine_stats stats();
    // Layers of the current (or last) eval that have finished; lock-free, for progress and tests.
    int eval_progress() const { return progress_.layers_done.load(std::memory_order_relaxed); }

private:
    static bool abort_cb(void * data);

    engine_params params_;
    std::unique_ptr<stage_weights> w_;
    std::unique_ptr<kv_cache> kv_;
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

    std::vector<uint8_t> graph_meta_;  // memory of the graph context (tensor and graph metadata)
    cached_graph graph_;
    layer_progress progress_;
    std::atomic<bool> cancel_{false};
    std::mutex mutex_;                 // one eval or cache op at a time
    std::mutex stats_mutex_;           // guards stats_ only, so stats() does not wait for an eval
    engine_stats stats_;
};

}  // namespace pipeinfer
