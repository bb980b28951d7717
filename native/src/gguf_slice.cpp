#include "gguf_slice.h"

#include "errors.h"
#include "gguf_file.h"

#include <memory>

namespace pipeinfer {

namespace {
struct gguf_ctx_deleter { void operator()(gguf_context * c) const { gguf_free(c); } };
}  // namespace

slice_layout plan_slice(const std::string & path, const std::vector<std::string> & tensor_names,
                        const std::string & source_sha256, uint32_t layer_begin, uint32_t layer_end) {
    quiet_ggml_log quiet;
    const gguf_file src(path, /*with_tensor_meta=*/ true);
    const int64_t vocab_id = gguf_find_tensor(src.ctx(), "token_embd.weight");
    if (vocab_id < 0) throw model_file_error(path + ": tensor 'token_embd.weight' is missing");
    const uint32_t n_vocab = (uint32_t) ggml_get_tensor(src.tensor_meta(), "token_embd.weight")->ne[1];

    std::unique_ptr<gguf_context, gguf_ctx_deleter> dst(gguf_init_empty());
    gguf_set_kv(dst.get(), src.ctx());
    // An empty context lays tensors out at the default alignment whatever general.alignment says,
    // so the key is dropped rather than left to contradict the layout.
    gguf_remove_key(dst.get(), "general.alignment");
    gguf_set_val_u32(dst.get(), slice_key_n_vocab, n_vocab);
    gguf_set_val_str(dst.get(), slice_key_source, source_sha256.c_str());
    gguf_set_val_u32(dst.get(), slice_key_begin, layer_begin);
    gguf_set_val_u32(dst.get(), slice_key_end, layer_end);

    std::vector<uint64_t> src_offsets;
    const size_t src_data = gguf_get_data_offset(src.ctx());
    for (const std::string & name : tensor_names) {
        const int64_t id = gguf_find_tensor(src.ctx(), name.c_str());
        if (id < 0) throw model_file_error(path + ": tensor '" + printable(name) + "' is missing");
        gguf_add_tensor(dst.get(), ggml_get_tensor(src.tensor_meta(), name.c_str()));
        src_offsets.push_back(src_data + gguf_get_tensor_offset(src.ctx(), id));
    }

    slice_layout out;
    out.meta.resize(gguf_get_meta_size(dst.get()));  // includes the padding before the data
    gguf_get_meta_data(dst.get(), out.meta.data());
    const uint64_t data = out.meta.size();
    out.total_size = data;
    for (size_t i = 0; i < tensor_names.size(); ++i) {
        slice_piece p;
        p.src_offset = src_offsets[i];
        p.size = gguf_get_tensor_size(dst.get(), (int64_t) i);
        p.dst_offset = data + gguf_get_tensor_offset(dst.get(), (int64_t) i);
        if (p.src_offset + p.size > src.file_size()) {
            throw model_file_error(path + ": the file ends inside tensor '" + printable(tensor_names[i]) + "' (truncated?)");
        }
        out.pieces.push_back(p);
    }
    // ggml pads every tensor, the last one too, to the alignment.
    const uint64_t align = gguf_get_alignment(dst.get());
    const uint64_t end = out.pieces.empty() ? data : out.pieces.back().dst_offset + out.pieces.back().size;
    out.total_size = (end + align - 1) / align * align;
    return out;
}

}  // namespace pipeinfer
