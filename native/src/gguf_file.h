// One reader of GGUF files for the whole package: the layer engine's loader (model_loader.cpp)
// and the metadata-only read that `inspect` and job planning use (module.cpp: gguf_metadata).
//
// gguf_file opens the file, checks the magic itself (gguf_init_from_file's reasons would only go
// to the log), parses the header with ggml's reader with the ggml log kept quiet, and gives typed
// access to the metadata. No tensor data is read here.
#pragma once

#include "ggml.h"
#include "gguf.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pipeinfer {

// While alive, keeps ggml's debug/info lines out of the log and passes warnings and errors on to
// whatever logger was installed (llama_cpp's, if loaded), or, with `capture`, appends them there
// instead (the caller puts them in its exception). The logger is process-global, so one
// quiet_ggml_log exists at a time across threads (a static recursive mutex is held for the
// object's lifetime; nesting in one thread is fine).
class quiet_ggml_log {
public:
    explicit quiet_ggml_log(std::string * capture = nullptr);
    ~quiet_ggml_log();
    quiet_ggml_log(const quiet_ggml_log &) = delete;
    quiet_ggml_log & operator=(const quiet_ggml_log &) = delete;

private:
    static void filter(ggml_log_level level, const char * text, void * ud);
    ggml_log_callback prev_cb_ = nullptr;
    void * prev_ud_ = nullptr;
    std::string * capture_ = nullptr;
};

// Text taken from a file, fit for an error message: printable ASCII kept, every other byte as \xNN
// (the message becomes a Python str, which must be valid UTF-8), cut after max_len characters.
std::string printable(const std::string & text, size_t max_len = 200);

class gguf_file {
public:
    // Throws model_file_error: "not found", not a regular file, wrong magic, unparsable header.
    // with_tensor_meta: also build a ggml context holding the tensors' metadata (the loader needs it).
    gguf_file(const std::string & path, bool with_tensor_meta);
    ~gguf_file();
    gguf_file(const gguf_file &) = delete;
    gguf_file & operator=(const gguf_file &) = delete;

    const std::string & path() const { return path_; }
    int fd() const { return fd_; }
    uint64_t file_size() const { return file_size_; }
    const gguf_context * ctx() const { return ctx_; }
    ggml_context * tensor_meta() const { return meta_; }  // null unless with_tensor_meta

    bool has_tensor(const char * name) const { return gguf_find_tensor(ctx_, name) >= 0; }

    // Typed metadata. Integers may be stored with any integer type; per-layer keys (head_count...)
    // may be arrays whose elements must then all be equal. A missing required key, or a value of
    // the wrong type, throws model_file_error naming the key.
    std::string get_str(const std::string & key, const std::string & def, bool required) const;
    uint64_t get_uint(const std::string & key, uint64_t def, bool required) const;
    float get_f32(const std::string & key, float def) const;
    bool is_array(const std::string & key) const;

private:
    void close();
    static bool is_integer_type(gguf_type t);
    uint64_t int_at(const std::string & key, gguf_type t, const void * data, size_t i) const;
    [[noreturn]] void missing(const std::string & key) const;
    [[noreturn]] void bad_type(const std::string & key, const char * what) const;

    std::string path_;
    int fd_ = -1;
    uint64_t file_size_ = 0;
    gguf_context * ctx_ = nullptr;
    ggml_context * meta_ = nullptr;
};

}  // namespace pipeinfer
