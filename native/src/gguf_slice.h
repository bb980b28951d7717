// A rank slice of a GGUF model: a valid GGUF file with every key/value of the source, a few
// pipeinfer.slice.* keys, and only the tensors a stage needs, byte for byte. The head computes
// the slice's layout here and streams it (runtime/weight_stream.py); the rank writes the bytes in
// order, and the layer engine loads the slice like any model file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pipeinfer {

// One tensor's bytes: copied from src_offset in the source file to dst_offset in the slice.
struct slice_piece {
    uint64_t src_offset = 0;
    uint64_t size = 0;
    uint64_t dst_offset = 0;
};

struct slice_layout {
    std::vector<uint8_t> meta;        // header, key/values, tensor table and the padding before the data
    std::vector<slice_piece> pieces;  // in slice order, dst_offset increasing
    uint64_t total_size = 0;          // bytes of the slice file
};

// The keys a slice adds. n_vocab: the vocabulary size, which a stage without token_embd cannot
// read from the tensor table; the rest say what the slice is a part of.
inline constexpr const char * slice_key_n_vocab = "pipeinfer.slice.n_vocab";
inline constexpr const char * slice_key_source = "pipeinfer.slice.source_sha256";
inline constexpr const char * slice_key_begin = "pipeinfer.slice.layer_begin";
inline constexpr const char * slice_key_end = "pipeinfer.slice.layer_end";

// Throws model_file_error for an unreadable file or a tensor name it does not have.
slice_layout plan_slice(const std::string & path, const std::vector<std::string> & tensor_names,
                        const std::string & source_sha256, uint32_t layer_begin, uint32_t layer_end);

}  // namespace pipeinfer
