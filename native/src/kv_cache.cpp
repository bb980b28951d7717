#include "kv_cache.h"

#include "gguf_file.h"

#include "errors.h"
#include "huge_pages.h"
#include "ggml-cpu.h"

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

kv_cache::kv_cache(uint32_t size, uint32_t n_seq_max, int n_layer, int64_t n_embd_gqa, bool v_trans)
    : cells_(size), n_seq_max_(n_seq_max), v_trans_(v_trans) {
    ggml_init_params ip = { ggml_tensor_overhead() * (2 * (size_t) n_layer + 1), nullptr, true };
    ctx_ = ggml_init(ip);
    if (!ctx_) throw engine_failure("failed to create the KV cache context");
    for (int il = 0; il < n_layer; ++il) {
        k_.push_back(ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, n_embd_gqa, size));
        v_.push_back(v_trans ? ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, size, n_embd_gqa)
                             : ggml_new_tensor_2d(ctx_, GGML_TYPE_F16, n_embd_gqa, size));
        ggml_format_name(k_.back(), "cache_k_l%d", il);
        ggml_format_name(v_.back(), "cache_v_l%d", il);
    }
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

size_t kv_cache::bytes() const { return ggml_backend_buffer_get_size(buf_); }

std::vector<uint32_t> kv_cache::claim(const std::vector<kv_token> & tokens) {
    const uint32_t n_free = size() - n_used_;
    if (tokens.size() > n_free) {
        throw kv_cache_full("batch of " + std::to_string(tokens.size()) + " tokens does not fit in the KV cache: " +
                            std::to_string(n_free) + " of " + std::to_string(size()) +
                            " cells are free; remove sequences (seq_rm) or open the engine with a larger n_ctx");
    }
    // Lowest free cells first: for a single sequence this is the placement llama.cpp uses,
    // which keeps the attention sums in the same order as llama.cpp's.
    std::vector<uint32_t> idxs;
    idxs.reserve(tokens.size());
    for (uint32_t i = 0; i < size() && idxs.size() < tokens.size(); ++i) {
        if (cells_[i].empty()) idxs.push_back(i);
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

uint32_t kv_cache::n_kv() const {
    uint32_t used_max_p1 = 0;
    for (uint32_t i = size(); i > 0; --i) {
        if (!cells_[i - 1].empty()) {
            used_max_p1 = i;
            break;
        }
    }
    const uint32_t pad = 256;
    const uint32_t padded = std::max(pad, ((used_max_p1 + pad - 1) / pad) * pad);
    return std::min(size(), padded);
}

namespace {
template <typename T> T mask_value(float v);
template <> float mask_value<float>(float v) { return v; }
template <> ggml_fp16_t mask_value<ggml_fp16_t>(float v) { return ggml_fp32_to_fp16(v); }
}  // namespace

template <typename T>
void kv_cache::fill_mask(T * mask, uint32_t n_kv, const std::vector<kv_token> & tokens, uint32_t n_swa) const {
    const T keep = mask_value<T>(0.0f);
    const T drop = mask_value<T>(-INFINITY);
    for (size_t t = 0; t < tokens.size(); ++t) {
        T * row = mask + t * n_kv;
        const kv_token & tok = tokens[t];
        for (uint32_t j = 0; j < n_kv; ++j) {
            const kv_cell & c = cells_[j];
            const bool in_window = n_swa == 0 || tok.pos - c.pos < (int32_t) n_swa;
            row[j] = ((c.seqs & tok.seqs) != 0 && c.pos <= tok.pos && in_window) ? keep : drop;
        }
    }
}
template void kv_cache::fill_mask<float>(float *, uint32_t, const std::vector<kv_token> &, uint32_t) const;
template void kv_cache::fill_mask<ggml_fp16_t>(ggml_fp16_t *, uint32_t, const std::vector<kv_token> &, uint32_t) const;

bool kv_cache::position_order(uint32_t n_kv, const std::vector<kv_token> & tokens, std::vector<int32_t> & order) const {
    order.assign(tokens.size() * (size_t) n_kv, -1);
    bool identity = true;
    for (size_t t = 0; t < tokens.size(); ++t) {
        int32_t * row = order.data() + t * n_kv;
        const kv_token & tok = tokens[t];
        for (uint32_t j = 0; j < n_kv; ++j) {
            const kv_cell & c = cells_[j];
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
    norm_range(p0, p1);
    const uint64_t src_bit = 1ull << src;
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
}

}  // namespace pipeinfer
