#include "gguf_file.h"

#include "errors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

namespace pipeinfer {

namespace {
std::recursive_mutex & log_mutex() {  // recursive: the engine's load is quiet, and so is the gguf_file it opens
    static std::recursive_mutex m;
    return m;
}
}  // namespace

quiet_ggml_log::quiet_ggml_log(std::string * capture) : capture_(capture) {
    log_mutex().lock();
    ggml_log_get(&prev_cb_, &prev_ud_);
    ggml_log_set(&quiet_ggml_log::filter, this);
}

quiet_ggml_log::~quiet_ggml_log() {
    ggml_log_set(prev_cb_, prev_ud_);
    log_mutex().unlock();
}

void quiet_ggml_log::filter(ggml_log_level level, const char * text, void * ud) {
    auto * self = (quiet_ggml_log *) ud;
    if (level != GGML_LOG_LEVEL_WARN && level != GGML_LOG_LEVEL_ERROR) return;
    if (self->capture_) {
        self->capture_->append(text);
    } else if (self->prev_cb_) {
        self->prev_cb_(level, text, self->prev_ud_);
    }
}

std::string printable(const std::string & text, size_t max_len) {
    std::string out;
    for (unsigned char c : text) {
        if (out.size() >= max_len) return out + "...";
        if (c >= 0x20 && c < 0x7f) {
            out += (char) c;
        } else {
            static const char hex[] = "0123456789abcdef";
            out += std::string("\\x") + hex[c >> 4] + hex[c & 15];
        }
    }
    return out;
}

gguf_file::gguf_file(const std::string & path, bool with_tensor_meta) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
        if (errno == ENOENT) throw model_file_error("model file not found: " + path);
        throw model_file_error(path + ": cannot open model file (" + std::strerror(errno) + ")");
    }
    try {
        struct stat st {};
        if (fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
            throw model_file_error(path + ": not a regular file");
        }
        file_size_ = (uint64_t) st.st_size;
        char magic[4] = {0, 0, 0, 0};
        if (file_size_ < 4 || ::pread(fd_, magic, 4, 0) != 4 || std::memcmp(magic, "GGUF", 4) != 0) {
            throw model_file_error(path + ": not a GGUF file (wrong magic; expected 'GGUF' in the first 4 bytes)");
        }
        gguf_init_params gp = { /*no_alloc=*/ true, /*ctx=*/ with_tensor_meta ? &meta_ : nullptr };
        std::string reason;  // ggml logs why it refuses a header; that goes into the exception
        {
            quiet_ggml_log quiet(&reason);
            ctx_ = gguf_init_from_file(path.c_str(), gp);
        }
        if (!ctx_ || (with_tensor_meta && !meta_)) {
            throw model_file_error(path + ": failed to parse the GGUF header (file truncated or corrupted" +
                                   (reason.empty() ? "" : ": " + printable(reason.substr(0, reason.find('\n')))) + ")");
        }
    } catch (...) {
        close();
        throw;
    }
}

gguf_file::~gguf_file() { close(); }

void gguf_file::close() {
    if (meta_) ggml_free(meta_);
    if (ctx_) gguf_free(ctx_);
    if (fd_ >= 0) ::close(fd_);
    meta_ = nullptr;
    ctx_ = nullptr;
    fd_ = -1;
}

std::string gguf_file::get_str(const std::string & key, const std::string & def, bool required) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    if (id < 0) {
        if (required) missing(key);
        return def;
    }
    if (gguf_get_kv_type(ctx_, id) != GGUF_TYPE_STRING) bad_type(key, "a string");
    return gguf_get_val_str(ctx_, id);
}

uint64_t gguf_file::get_uint(const std::string & key, uint64_t def, bool required) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    if (id < 0) {
        if (required) missing(key);
        return def;
    }
    // The type is checked before asking for the data: gguf_get_val_data and gguf_get_arr_data
    // abort the process (GGML_ASSERT) on a string, and a crafted file can put one anywhere.
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    if (t != GGUF_TYPE_ARRAY) {
        if (!is_integer_type(t)) bad_type(key, "an integer");
        return int_at(key, t, gguf_get_val_data(ctx_, id), 0);
    }
    const gguf_type at = gguf_get_arr_type(ctx_, id);
    const size_t n = gguf_get_arr_n(ctx_, id);
    if (!is_integer_type(at)) bad_type(key, "an integer or an array of integers");
    if (n == 0) bad_type(key, "a non-empty array");
    const void * data = gguf_get_arr_data(ctx_, id);
    const uint64_t first = int_at(key, at, data, 0);
    for (size_t i = 1; i < n; ++i) {
        if (int_at(key, at, data, i) != first) {
            throw model_file_error(path_ + ": per-layer values of '" + key + "' differ; only uniform layers are supported");
        }
    }
    return first;
}

bool gguf_file::is_array(const std::string & key) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    return id >= 0 && gguf_get_kv_type(ctx_, id) == GGUF_TYPE_ARRAY;
}

float gguf_file::get_f32(const std::string & key, float def) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    if (id < 0) return def;
    switch (gguf_get_kv_type(ctx_, id)) {
        case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(ctx_, id);
        case GGUF_TYPE_FLOAT64: return (float) gguf_get_val_f64(ctx_, id);
        default: bad_type(key, "a float");
    }
}

bool gguf_file::is_integer_type(gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64:
            return true;
        default:
            return false;
    }
}

uint64_t gguf_file::int_at(const std::string & key, gguf_type t, const void * data, size_t i) const {
    int64_t v = 0;
    switch (t) {
        case GGUF_TYPE_UINT8:  v = ((const uint8_t  *) data)[i]; break;
        case GGUF_TYPE_INT8:   v = ((const int8_t   *) data)[i]; break;
        case GGUF_TYPE_UINT16: v = ((const uint16_t *) data)[i]; break;
        case GGUF_TYPE_INT16:  v = ((const int16_t  *) data)[i]; break;
        case GGUF_TYPE_UINT32: v = ((const uint32_t *) data)[i]; break;
        case GGUF_TYPE_INT32:  v = ((const int32_t  *) data)[i]; break;
        case GGUF_TYPE_UINT64: v = (int64_t) ((const uint64_t *) data)[i]; break;
        case GGUF_TYPE_INT64:  v = ((const int64_t  *) data)[i]; break;
        default: bad_type(key, "an integer");
    }
    if (v < 0) bad_type(key, "a non-negative integer");
    return (uint64_t) v;
}

void gguf_file::missing(const std::string & key) const {
    throw model_file_error(path_ + ": required metadata key '" + key + "' is missing");
}

void gguf_file::bad_type(const std::string & key, const char * what) const {
    throw model_file_error(path_ + ": metadata key '" + key + "' is not " + what);
}

}  // namespace pipeinfer
