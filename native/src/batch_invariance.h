// Matmuls that compute every activation row exactly as a one-row batch would (batch invariance).
//
// ggml's CPU matmuls change kernels with the number of activation rows, and each kernel rounds
// differently; the difference grows through the layers until a greedy argmax can flip. Speculative
// verification evaluates k tokens in one batch where plain decoding evaluates one, so to be
// lossless an invariant graph splits such matmuls into slices of rows that the one-row kernel
// computes. See batch_invariance.cpp for the kernels and their row thresholds.
#pragma once

#include "ggml.h"

#include <cstdint>

namespace pipeinfer {

// Largest slice of activation rows that MUL_MAT with weight w computes as one-row batches would.
int64_t invariant_rows(const ggml_tensor * w);

// w [n_in, n_out] x x [n_in, n] -> [n_out, n]; with invariant, in row slices of invariant_rows(w).
ggml_tensor * mul_mat_rows(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x, bool invariant);

// Experts: w [n_in, n_out, n_expert] x x [n_in, n_x, n_tokens] with ids I32 [n_used, n_tokens]
// -> [n_out, n_used, n_tokens] (ggml_mul_mat_id); with invariant, in slices of tokens small enough
// that no expert gets more rows than its one-row kernel computes identically.
ggml_tensor * mul_mat_id_rows(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x, ggml_tensor * ids, bool invariant);

}  // namespace pipeinfer
