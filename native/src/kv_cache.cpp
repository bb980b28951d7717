#include "kv_cache.h"

#include "gguf_file.h"

#include "errors.h"
#include "huge_pages.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <string>

namespace pipeinfer {

namespace {
// Normalizes a llama.cpp range: negative p0 -> 0, negative p1 -> +inf.
void norm_range(int32_t & p0, int32_t & p1) {
    if (p0 < 0) p0 = 0;
    if (p1 < 0) p1 = std::numeric_limits<int32_t>::max();
}
}  // namespace

kv_cache::kv_cache(uint32_t size, uint32_t n_seq_max, const std::vector<bool> & layers, int64_t n_embd_gqa,
                   bool v_trans, uint32_t n_swa, uint32_t n_slots)
    : n_swa_(n_swa), lost_below_(n_seq_max, 0), cells_(size), n_seq_max_(n_seq_max), v_trans_(v_trans) {
    if (n_slots < 1 || size % n_slots != 0 || n_seq_max % n_slots != 0) {
        throw invalid_input("n_slots=" + std::to_string(n_slots) + " must divide n_ctx=" + std::to_string(size) +
                            " and n_seq_max=" + std::to_string(n_seq_max));
    }
    n_slots_ = n_slots;
    slot_size_ = size / n_slots;
    seqs_per_slot_ = n_seq_max / n_slots;
    ggml_init_params ip = { ggml_tensor_overhead() * (2 * layers.size() + 1), nullptr, true };
    ctx_ = ggml_init(ip);
    if (!ctx_) throw engine_failure("failed to create the KV cache context");
    for (size_t il = 0; il < layers.size(); ++il) {
        if (!layers[il]) {
            k_.push_back(nullptr);
            v_.push_back(nullptr);
            continue;
        }
        k_.push_back(ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, n_embd_gqa, size));
        v_.push_back(v_trans ? ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, size, n_embd_gqa)
                             : ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, n_embd_gqa, size));
        ggml_format_name(k_.back(), "cache_k_l%d", (int) il);
        ggml_format_name(v_.back(), "cache_v_l%d", (int) il);
    }
    if (ggml_get_first_tensor(ctx_) == nullptr) return;  // cell bookkeeping only (no layer of this kind)
    {
        // ggml logs a failed allocation on stderr; the engine's exception says it once, with the fix.
        std::string ggml_said;
        quiet_ggml_log quiet(&ggml_said);
        buf_ = ggml_backend_alloc_ctx_tensors_from_buft(ctx_, ggml_backend_cpu_buffer_type());
    }
    if (!buf_) {
        ggml_free(ctx_);
        throw std::bad_alloc();  // the engine reports the size and the fix
    }
    advise_huge_pages(buf_);  // before the clear below touches its pages
    // Zero it: masked cells still enter the KQ/V products (multiplied by 0), so they must not hold NaNs.
    ggml_backend_buffer_clear(buf_, 0);
}

kv_cache::~kv_cache() {
    if (buf_) ggml_backend_buffer_free(buf_);
    if (ctx_) ggml_free(ctx_);
}

size_t kv_cache::bytes() const { return buf_ ? ggml_backend_buffer_get_size(buf_) : 0; }

// Frees cells out of every owner's window, those furthest behind first, until n_needed are free.
void kv_cache::prune(uint32_t n_needed) {
    std::vector<int32_t> pmax(n_seq_max_, -1);
    for (const auto & c : cells_) {
        for (uint32_t s = 0; s < n_seq_max_; ++s) {
            if (c.seqs & (1ull << s)) pmax[s] = std::max(pmax[s], c.pos);
        }
    }
    std::vector<std::pair<int32_t, uint32_t>> prunable;  // (lag behind the nearest owner's window, cell)
    for (uint32_t i = 0; i < size(); ++i) {
        const kv_cell & c = cells_[i];
        if (c.empty()) continue;
        int32_t lag = std::numeric_limits<int32_t>::max();
        for (uint32_t s = 0; s < n_seq_max_; ++s) {
            if (c.seqs & (1ull << s)) lag = std::min(lag, pmax[s] - (int32_t) n_swa_ + 1 - c.pos);
        }
        if (lag > 0) prunable.emplace_back(lag, i);
    }
    std::sort(prunable.begin(), prunable.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    for (const auto & pr : prunable) {
        if (size() - n_used_ >= n_needed) break;
        kv_cell & c = cells_[pr.second];
        for (uint32_t s = 0; s < n_seq_max_; ++s) {
            if (c.seqs & (1ull << s)) lost_below_[s] = std::max(lost_below_[s], c.pos + 1);
        }
        erase_cell(pr.second);
    }
}

void kv_cache::check_window(const std::vector<kv_token> & tokens) const {
    for (const auto & t : tokens) {
        for (uint32_t s = 0; s < n_seq_max_; ++s) {
            if (!(t.seqs & (1ull << s)) || lost_below_[s] == 0 || t.pos - (int32_t) n_swa_ + 1 >= lost_below_[s]) continue;
            throw kv_cache_full("sequence " + std::to_string(s) + " at position " + std::to_string(t.pos) +
                                " needs positions the sliding-window cache has pruned (below " +
                                std::to_string(lost_below_[s]) + "); re-evaluate the sequence from 0 or open "
                                "the engine with the full cache (PIPEINFER_SWA_FULL=1)");
        }
    }
}

std::vector<uint32_t> kv_cache::claim(const std::vector<kv_token> & tokens) {
    if (n_swa_ > 0) {
        check_window(tokens);
        if (size() - n_used_ < tokens.size()) prune((uint32_t) tokens.size());
    }
    const uint32_t slot = batch_slot(tokens), base = slot_base(slot), end = base + slot_size_;
    // Lowest free cells first: for a single sequence this is the placement llama.cpp uses,
    // which keeps the attention sums in the same order as llama.cpp's.
    std::vector<uint32_t> idxs;
    idxs.reserve(tokens.size());
    for (uint32_t i = base; i < end && idxs.size() < tokens.size(); ++i) {
        if (cells_[i].empty()) idxs.push_back(i);
    }
    if (idxs.size() < tokens.size()) {
        const std::string where = n_slots_ > 1 ? " (KV slot " + std::to_string(slot) + " of " + std::to_string(n_slots_) + ")" : std::string();
        throw kv_cache_full("batch of " + std::to_string(tokens.size()) + " tokens does not fit in the KV cache" + where +
                            ": " + std::to_string(idxs.size()) + " of " + std::to_string(slot_size_) +
                            " cells are free; remove sequences (seq_rm) or open the engine with a larger n_ctx");
    }
    for (size_t t = 0; t < tokens.size(); ++t) {
        cells_[idxs[t]].pos  = tokens[t].pos;
        cells_[idxs[t]].seqs = tokens[t].seqs;
    }
    n_used_ += (uint32_t) tokens.size();
    return idxs;
}

void kv_cache::release(const std::vector<uint32_t> & idxs) {
    for (uint32_t i : idxs) erase_cell(i);
}

void kv_cache::erase_cell(uint32_t i) {
    if (!cells_[i].empty()) n_used_--;
    cells_[i].seqs = 0;
    cells_[i].pos  = -1;
}

uint32_t kv_cache::batch_slot(const std::vector<kv_token> & tokens) const {
    if (n_slots_ == 1) return 0;
    const uint32_t slot = slot_of_seq(__builtin_ctzll(tokens.at(0).seqs));
    for (const auto & t : tokens) {
        for (uint64_t m = t.seqs; m; m &= m - 1) {
            const uint32_t s = slot_of_seq(__builtin_ctzll(m));
            if (s != slot) {
                throw invalid_input("a batch mixes sequences of KV slots " + std::to_string(slot) + " and " +
                                    std::to_string(s) + "; each batch must stay in one slot's sequences");
            }
        }
    }
    return slot;
}

uint32_t kv_cache::n_kv(uint32_t slot) const {
    const uint32_t base = slot_base(slot);
    uint32_t used_max_p1 = 0;
    for (uint32_t i = slot_size_; i > 0; --i) {
        if (!cells_[base + i - 1].empty()) {
            used_max_p1 = i;
            break;
        }
    }
    const uint32_t pad = 256;
    const uint32_t padded = std::max(pad, ((used_max_p1 + pad - 1) / pad) * pad);
    return std::min(slot_size_, padded);
}

namespace {
template <typename T> T mask_value(float v);
template <> float mask_value<float>(float v) { return v; }
template <> ggml_fp16_t mask_value<ggml_fp16_t>(float v) { return ggml_fp32_to_fp16(v); }
}  // namespace

template <typename T>
void kv_cache::fill_mask(T * mask, uint32_t base, uint32_t n_kv, const std::vector<kv_token> & tokens, uint32_t n_swa) const {
    const T keep = mask_value<T>(0.0f);
    const T drop = mask_value<T>(-INFINITY);
    for (size_t t = 0; t < tokens.size(); ++t) {
        T * row = mask + t * n_kv;
        const kv_token & tok = tokens[t];
        for (uint32_t j = 0; j < n_kv; ++j) {
            const kv_cell & c = cells_[base + j];
            const bool in_window = n_swa == 0 || tok.pos - c.pos < (int32_t) n_swa;
            row[j] = ((c.seqs & tok.seqs) != 0 && c.pos <= tok.pos && in_window) ? keep : drop;
        }
    }
}
template void kv_cache::fill_mask<float>(float *, uint32_t, uint32_t, const std::vector<kv_token> &, uint32_t) const;
template void kv_cache::fill_mask<ggml_fp16_t>(ggml_fp16_t *, uint32_t, uint32_t, const std::vector<kv_token> &,
                                               uint32_t) const;

bool kv_cache::window_rows(const std::vector<kv_token> & tokens, size_t t0, size_t t1, int32_t base, uint32_t n,
                           int32_t * rows) const {
    uint64_t seqs = 0;
    int32_t pmax = -1;
    for (size_t t = t0; t < t1; ++t) {
        seqs |= tokens[t].seqs;
        pmax = std::max(pmax, tokens[t].pos);
    }
    std::fill(rows, rows + n, -1);
    for (uint32_t i = 0; i < size(); ++i) {
        const kv_cell & c = cells_[i];
        if ((c.seqs & seqs) == 0 || c.pos < base || c.pos >= base + (int32_t) n || c.pos > pmax) continue;
        if (rows[c.pos - base] != -1) return false;
        rows[c.pos - base] = (int32_t) i;
    }
    return true;
}

template <typename T>
void kv_cache::fill_window_mask(T * row, const int32_t * rows, uint32_t n, const kv_token & tok) const {
    const T keep = mask_value<T>(0.0f);
    const T drop = mask_value<T>(-INFINITY);
    for (uint32_t j = 0; j < n; ++j) {
        const kv_cell * c = rows[j] >= 0 ? &cells_[rows[j]] : nullptr;
        const bool vis = c && (c->seqs & tok.seqs) != 0 && c->pos <= tok.pos && tok.pos - c->pos < (int32_t) n_swa_;
        row[j] = vis ? keep : drop;
    }
}
template void kv_cache::fill_window_mask<float>(float *, const int32_t *, uint32_t, const kv_token &) const;
template void kv_cache::fill_window_mask<ggml_fp16_t>(ggml_fp16_t *, const int32_t *, uint32_t, const kv_token &) const;

bool kv_cache::position_order(uint32_t base, uint32_t n_kv, const std::vector<kv_token> & tokens,
                              std::vector<int32_t> & order) const {
    order.assign(tokens.size() * (size_t) n_kv, -1);
    bool identity = true;
    for (size_t t = 0; t < tokens.size(); ++t) {
        int32_t * row = order.data() + t * n_kv;
        const kv_token & tok = tokens[t];
        for (uint32_t j = 0; j < n_kv; ++j) {
            const kv_cell & c = cells_[base + j];
            if ((c.seqs & tok.seqs) == 0 || c.pos > tok.pos) continue;
            if (c.pos < 0 || (uint32_t) c.pos >= n_kv || row[c.pos] != -1) return false;  // cannot reorder
            row[c.pos] = (int32_t) j;
            if ((uint32_t) c.pos != j) identity = false;
        }
    }
    return !identity;
}

void kv_cache::check_seq(int32_t seq_id, const char * what) const {
    if (seq_id < 0 || (uint32_t) seq_id >= n_seq_max_) {
        throw invalid_input(std::string(what) + ": sequence id " + std::to_string(seq_id) +
                            " is out of range [0, " + std::to_string(n_seq_max_) + ")");
    }
}

void kv_cache::seq_rm(int32_t seq_id, int32_t p0, int32_t p1) {
    if (seq_id >= 0) check_seq(seq_id, "seq_rm");
    norm_range(p0, p1);
    if (p0 == 0 && p1 == std::numeric_limits<int32_t>::max()) {  // the whole sequence: nothing is lost any more
        for (uint32_t s = 0; s < n_seq_max_; ++s) {
            if (seq_id < 0 || (int32_t) s == seq_id) lost_below_[s] = 0;
        }
    }
    for (uint32_t i = 0; i < size(); ++i) {
        kv_cell & c = cells_[i];
        if (c.empty() || c.pos < p0 || c.pos >= p1) continue;
        if (seq_id < 0) {
            erase_cell(i);
        } else if (c.seqs & (1ull << seq_id)) {
            c.seqs &= ~(1ull << seq_id);
            if (c.empty()) {
                c.pos = -1;
                n_used_--;
            }
        }
    }
}

void kv_cache::seq_cp(int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    seq_cp_many(src, {dst}, p0, p1);
}

void kv_cache::seq_cp_many(int32_t src, const std::vector<int32_t> & dsts, int32_t p0, int32_t p1) {
    check_seq(src, "seq_cp");
    uint64_t add = 0;
    for (int32_t d : dsts) {
        check_seq(d, "seq_cp");
        add |= 1ull << d;
    }
    for (int32_t d : dsts) {
        if (slot_of_seq(d) != slot_of_seq(src)) {
            throw invalid_input("seq_cp from sequence " + std::to_string(src) + " to " + std::to_string(d) +
                                " crosses KV slots; copies stay inside one slot's sequences");
        }
    }
    norm_range(p0, p1);
    const uint64_t src_bit = 1ull << src;
    for (int32_t d : dsts) {  // the copy lacks what the source lacks
        lost_below_[d] = seq_pos_max(d) < 0 ? lost_below_[src] : std::max(lost_below_[d], lost_below_[src]);
    }
    for (auto & c : cells_) {
        if ((c.seqs & src_bit) && c.pos >= p0 && c.pos < p1) c.seqs |= add;
    }
}

void kv_cache::seq_keep(int32_t seq_id) {
    check_seq(seq_id, "seq_keep");
    const uint64_t bit = 1ull << seq_id;
    for (uint32_t i = 0; i < size(); ++i) {
        kv_cell & c = cells_[i];
        if (c.empty()) continue;
        if (c.seqs & bit) c.seqs = bit;
        else erase_cell(i);
    }
    for (uint32_t s = 0; s < n_seq_max_; ++s) {
        if ((int32_t) s != seq_id) lost_below_[s] = 0;
    }
}

int32_t kv_cache::seq_pos_max(int32_t seq_id) const {
    check_seq(seq_id, "seq_pos_max");
    int32_t r = -1;
    for (const auto & c : cells_) {
        if (c.seqs & (1ull << seq_id)) r = std::max(r, c.pos);
    }
    return r;
}

int32_t kv_cache::seq_pos_min(int32_t seq_id) const {
    check_seq(seq_id, "seq_pos_min");
    int32_t r = -1;
    for (const auto & c : cells_) {
        if ((c.seqs & (1ull << seq_id)) && (r < 0 || c.pos < r)) r = c.pos;
    }
    return r;
}

void kv_cache::clear() {
    for (auto & c : cells_) c = kv_cell{};
    n_used_ = 0;
    std::fill(lost_below_.begin(), lost_below_.end(), 0);
}

}  // namespace pipeinfer
