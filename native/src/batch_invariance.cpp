#include "batch_invariance.h"

#include "ggml-backend.h"

#include <algorithm>
#include <climits>
#include <cstring>

namespace pipeinfer {

namespace {

bool in_repack_buffer(const ggml_tensor * w) {
    if (!w->buffer) return false;
    const char * name = ggml_backend_buft_name(ggml_backend_buffer_get_type(w->buffer));
    return name && std::strstr(name, "REPACK");
}

// Types the CPU backend's tiled K-quant kernel (ggml-cpu/tiled) takes over from 8 rows, in MUL_MAT
// and, per expert, in MUL_MAT_ID, unless the weight is repacked.
bool has_tiled_kernel(ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q6_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q2_K:
        case GGML_TYPE_IQ4_XS: case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S:
        case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ1_S: case GGML_TYPE_IQ1_M:
            return true;
        default:
            return false;
    }
}

// Largest number of rows routed to one expert that MUL_MAT_ID computes as one-row batches would.
// Unlike MUL_MAT it has no tinyBLAS path: each (row, output) is one vec_dot of the row, or, for a
// repacked weight, one gemv per row. Only the tiled K-quant kernel depends on the row count.
int64_t invariant_rows_per_expert(const ggml_tensor * w) {
    if (in_repack_buffer(w) || !has_tiled_kernel(w->type)) return INT64_MAX;
    return 7;
}

}  // namespace

// MUL_MAT: llamafile's tinyBLAS takes over from 2 rows (F32/F16/BF16/Q8_0/Q4_0/Q5_0/IQ4_NL weights,
// and the F16 KV cache in attention), repacked weights switch from gemv to gemm from 4 rows
// (up to 3 rows still use gemv, row by row), and other types go through vec_dot, invariant up to
// 7 rows (the tiled K-quant kernel takes over from 8).
int64_t invariant_rows(const ggml_tensor * w) {
    if (in_repack_buffer(w)) return 3;
    switch (w->type) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_IQ4_NL:
            return 1;
        default:
            // Measured on this ggml (Q6_K, Q4_K without repack): rows stay bit-identical to a
            // one-row batch in slices of up to 7 rows, not from 8.
            return 7;
    }
}

ggml_tensor * mul_mat_rows(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x, bool invariant) {
    const int64_t n = x->ne[1];
    const int64_t step = invariant ? invariant_rows(w) : n;
    if (step >= n) return ggml_mul_mat(ctx, w, x);
    ggml_tensor * out = nullptr;
    for (int64_t i = 0; i < n; i += step) {
        const int64_t rows = std::min(step, n - i);
        ggml_tensor * xi = ggml_view_2d(ctx, x, x->ne[0], rows, x->nb[1], i * x->nb[1]);
        ggml_tensor * yi = ggml_mul_mat(ctx, w, xi);
        out = out ? ggml_concat(ctx, out, yi, 1) : yi;
    }
    return out;
}

ggml_tensor * mul_mat_id_rows(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x, ggml_tensor * ids, bool invariant) {
    const int64_t n = x->ne[2];
    // A token sends each of its rows to a different expert, so a slice of k tokens gives no expert
    // more than k rows.
    const int64_t step = invariant ? invariant_rows_per_expert(w) : n;
    if (step >= n) return ggml_mul_mat_id(ctx, w, x, ids);
    ggml_tensor * out = nullptr;
    for (int64_t i = 0; i < n; i += step) {
        const int64_t rows = std::min(step, n - i);
        ggml_tensor * xi = ggml_view_3d(ctx, x, x->ne[0], x->ne[1], rows, x->nb[1], x->nb[2], i * x->nb[2]);
        ggml_tensor * ii = ggml_view_2d(ctx, ids, ids->ne[0], rows, ids->nb[1], i * ids->nb[1]);
        ggml_tensor * yi = ggml_mul_mat_id(ctx, w, xi, ii);
        out = out ? ggml_concat(ctx, out, yi, 2) : yi;
    }
    return out;
}

}  // namespace pipeinfer
