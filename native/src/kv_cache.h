// Multi-sequence KV cache of one stage: cell metadata (position + set of sequence ids) and the
// F16 K/V tensors of the stage's layers, laid out as llama.cpp lays out its unified cache: K one
// row per cell; V transposed (one row per channel) without flash attention, one row per cell with.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

namespace pipeinfer {

constexpr uint32_t kv_max_seq = 64;  // sequence ids are bits of a uint64_t

// One cache cell. It is empty when no sequence owns it.
struct kv_cell {
    int32_t  pos  = -1;  // position of the token stored in the cell (-1 when empty)
    uint64_t seqs = 0;   // bit s set <=> the cell belongs to sequence s
    bool empty() const { return seqs == 0; }
};

// A token as the cache sees it: where it goes and which sequences it belongs to.
struct kv_token {
    int32_t  pos;   // position of the token
    uint64_t seqs;  // non-empty sequence set
};

class kv_cache {
public:
    // v_trans: store V transposed, as the soft_max attention path wants it (flash attention does not).
    // layers[li]: the cache holds K/V of local layer li (else k(li)/v(li) are null). n_swa > 0 makes
    // it a sliding-window cache (see claim).
    // n_slots > 1 splits the cells and the sequence ids into that many equal KV slots (parallel
    // requests): slot s owns cells [s*size/n_slots, (s+1)*size/n_slots) and sequence ids
    // [s*n_seq_max/n_slots, ...). A batch stays inside one slot, and attention reads only its slot's
    // cells, from the slot's first cell: a request sees exactly the cache it would have alone.
    kv_cache(uint32_t size, uint32_t n_seq_max, const std::vector<bool> & layers, int64_t n_embd_gqa, bool v_trans,
             uint32_t n_swa = 0, uint32_t n_slots = 1);
    ~kv_cache();
    kv_cache(const kv_cache &) = delete;
    kv_cache & operator=(const kv_cache &) = delete;

    uint32_t size() const { return (uint32_t) cells_.size(); }
    uint32_t n_seq_max() const { return n_seq_max_; }
    uint32_t n_used() const { return n_used_; }
    uint32_t n_slots() const { return n_slots_; }
    uint32_t slot_size() const { return slot_size_; }
    // The slot of a batch (every token's sequences in one slot; invalid_input otherwise).
    uint32_t batch_slot(const std::vector<kv_token> & tokens) const;
    uint32_t slot_base(uint32_t slot) const { return slot * slot_size_; }

    // Claims one free cell per token and stores pos/seqs there. Throws kv_cache_full (cache
    // unchanged) when there are not enough free cells. Returns the cell index of each token.
    // A sliding-window cache (n_swa > 0) first frees, when it lacks room, the cells no sequence can
    // attend to any more (cell.pos <= seq_pos_max(s) - n_swa for every s it belongs to), oldest
    // first and no more than needed, so that a rollback of the newest positions finds its window.
    std::vector<uint32_t> claim(const std::vector<kv_token> & tokens);
    // Sliding-window cache: positions below this were pruned from seq_id (0: none). A token of the
    // sequence at pos needs pos - n_swa + 1 >= window_floor; check_window throws otherwise.
    int32_t window_floor(int32_t seq_id) const { return lost_below_[seq_id]; }
    void check_window(const std::vector<kv_token> & tokens) const;
    uint32_t n_swa() const { return n_swa_; }

    // Sliding-window view for tokens [t0, t1): rows[j] = the cell holding position base + j that one
    // of these tokens may attend (shares a sequence, not newer than the newest token), -1 if none,
    // j < n. With base and n multiples of 256 every position keeps the SIMD lane and order it has in
    // plain decoding (cell index == position), so attention sums round the same. False when two
    // such cells hold one position (branches): each token then needs a view of its own.
    bool window_rows(const std::vector<kv_token> & tokens, size_t t0, size_t t1, int32_t base, uint32_t n,
                     int32_t * rows) const;
    // The window mask row of token tok over such a view.
    template <typename T>
    void fill_window_mask(T * row, const int32_t * rows, uint32_t n, const kv_token & tok) const;
    // Frees cells returned by claim (a failed or cancelled eval).
    void release(const std::vector<uint32_t> & idxs);

    // Number of leading cells of a slot attention looks at: the slot's used cells rounded up to 256
    // like llama.cpp, so that graph shapes stay constant between decode steps.
    uint32_t n_kv(uint32_t slot = 0) const;

    // mask[i*n_kv + j] = 0 if token i may attend cell j (shared sequence and cell.pos <= pos), else -inf.
    // With a sliding window n_swa > 0 the cell must also be among the last n_swa positions:
    // pos - cell.pos < n_swa (llama.cpp's LLAMA_SWA_TYPE_STANDARD).
    // T is float (soft_max path) or ggml_fp16_t (flash attention); both are instantiated in kv_cache.cpp.
    // Cells are counted from `base` (a slot's first cell).
    template <typename T>
    void fill_mask(T * mask, uint32_t base, uint32_t n_kv, const std::vector<kv_token> & tokens, uint32_t n_swa = 0) const;

    // order[i*n_kv + p] = the cell token i may attend that holds position p, or -1 (none).
    // Returns true when some token's cells are not laid out at cell index == position (the layout of
    // plain one-sequence decoding) and the cells it sees have distinct positions < n_kv: then
    // attention must gather them in position order to reproduce plain decoding bit for bit.
    // Cell indices are counted from `base` (a slot's first cell).
    bool position_order(uint32_t base, uint32_t n_kv, const std::vector<kv_token> & tokens, std::vector<int32_t> & order) const;

    // llama.cpp semantics: [p0, p1) with negative = open end; seq_id < 0 means every sequence.
    void seq_rm(int32_t seq_id, int32_t p0, int32_t p1);
    void seq_cp(int32_t src, int32_t dst, int32_t p0, int32_t p1);
    void seq_cp_many(int32_t src, const std::vector<int32_t> & dsts, int32_t p0, int32_t p1);
    void seq_keep(int32_t seq_id);
    int32_t seq_pos_max(int32_t seq_id) const;
    int32_t seq_pos_min(int32_t seq_id) const;
    void clear();

    ggml_tensor * k(int il) const { return k_[il]; }  // [n_embd_gqa, size] F16, il = local layer
    ggml_tensor * v(int il) const { return v_[il]; }  // [size, n_embd_gqa] F16 if v_trans, else like k
    bool v_trans() const { return v_trans_; }
    size_t bytes() const;

private:
    void check_seq(int32_t seq_id, const char * what) const;
    uint32_t slot_of_seq(int32_t seq_id) const { return (uint32_t) seq_id / seqs_per_slot_; }
    void erase_cell(uint32_t i);
    void prune(uint32_t n_needed);

    uint32_t n_swa_ = 0;
    std::vector<int32_t> lost_below_;  // per sequence (sliding-window cache)

    std::vector<kv_cell> cells_;
    uint32_t n_seq_max_;
    uint32_t n_slots_ = 1, slot_size_ = 0, seqs_per_slot_ = 0;
    uint32_t n_used_ = 0;        // non-empty cells
    bool v_trans_;
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    std::vector<ggml_tensor *> k_, v_;
};

}  // namespace pipeinfer
