#include "vocab_check.h"

#include <cstdint>
#include <string>
#include <unordered_set>

namespace pipeinfer {

namespace {

std::string array_of_strings_problem(const gguf_context * ctx, int64_t id, const char * key) {
    if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx, id) != GGUF_TYPE_STRING) {
        return std::string(key) + " is not an array of strings";
    }
    return "";
}

// Fills seen with the vocabulary's words (as llama.cpp names them).
std::string duplicate_token_problem(const gguf_context * ctx, int64_t id, std::unordered_set<std::string> & seen) {
    const size_t n = gguf_get_arr_n(ctx, id);
    if (n == 0) return "tokenizer.ggml.tokens is empty";
    if (n > (size_t) INT32_MAX) return "tokenizer.ggml.tokens has more than 2^31-1 entries";
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        std::string word = gguf_get_arr_str(ctx, id, i);
        if (word.empty()) word = "[EMPTY_" + std::to_string(i) + "]";  // as llama.cpp renames it
        if (!seen.insert(word).second) {
            return "tokenizer.ggml.tokens has the token '" + printable(word, 60) + "' twice (second at id " +
                   std::to_string(i) + ")";
        }
    }
    return "";
}

// A SentencePiece vocabulary (tokenizer.ggml.model "llama") spells a character it has no token for
// as byte tokens, "<0xXX>" or the byte itself. llama.cpp looks them up with std::map::at, and the
// std::out_of_range of a missing one goes through its C API into std::terminate (the process
// aborts on the first prompt with such a character).
std::string missing_byte_token_problem(const std::unordered_set<std::string> & words) {
    static const char * hex = "0123456789ABCDEF";
    for (int ch = 0; ch < 256; ++ch) {
        const char spelled[7] = {'<', '0', 'x', hex[ch >> 4], hex[ch & 15], '>', 0};
        if (!words.count(spelled) && !words.count(std::string(1, (char) ch))) {
            return std::string("tokenizer.ggml.tokens has no byte token ") + spelled +
                   " (a SentencePiece vocabulary needs all 256 to spell any text)";
        }
    }
    return "";
}

// llama.cpp's RWKV vocabulary stores its tokens escaped (\t \n \r \xHH, \ before any other
// character); the same decoding as its llama_unescape_rwkv_token, quirks included.
std::string unescape_rwkv(const std::string & escaped) {
    std::string out;
    bool escaping = false;
    uint8_t hex_remaining = 0, hex_acc = 0;
    for (const char c : escaped) {
        if (hex_remaining != 0) {
            const uint8_t value = (c >= 'a') ? (uint8_t) (c - 'a' + 10) : (uint8_t) (c - '0');
            hex_acc = (uint8_t) ((hex_acc << 4) + value);
            if (--hex_remaining == 0) {
                out.push_back((char) hex_acc);
                hex_acc = 0;
            }
        } else if (escaping) {
            if (c == 'x') hex_remaining = 2;
            else out.push_back(c == 't' ? '\t' : c == 'n' ? '\n' : c == 'r' ? '\r' : c);
            escaping = false;
        } else if (c == '\\') {
            escaping = true;
        } else {
            out.push_back(c);
        }
    }
    return out;
}

// llama.cpp's RWKV tokenizer takes the longest token matching at the current position, and when
// the text starts a token there but no token matches, it restarts at the same position: it
// loops forever, filling memory until the process aborts. A byte that begins some token must
// therefore be a token by itself (real RWKV vocabularies have all 256).
std::string rwkv_loop_problem(const gguf_context * ctx, int64_t id) {
    bool alone[256] = {}, begins[256] = {};
    for (size_t i = 0, n = gguf_get_arr_n(ctx, id); i < n; ++i) {
        std::string word = gguf_get_arr_str(ctx, id, i);
        if (word.empty()) word = "[EMPTY_" + std::to_string(i) + "]";  // as llama.cpp renames it
        const std::string text = unescape_rwkv(word);
        if (text.empty()) continue;
        begins[(uint8_t) text[0]] = true;
        if (text.size() == 1) alone[(uint8_t) text[0]] = true;
    }
    for (int b = 0; b < 256; ++b) {
        if (begins[b] && !alone[b]) {
            static const char * hex = "0123456789abcdef";
            return std::string("tokenizer.ggml.tokens has tokens that begin with the byte \\x") + hex[b >> 4] +
                   hex[b & 15] + " but not that byte alone (an RWKV vocabulary needs it to tokenize any text)";
        }
    }
    return "";
}

bool valid_utf8(const std::string & s) {
    size_t i = 0;
    while (i < s.size()) {
        const unsigned char c = (unsigned char) s[i];
        const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
        if (n == 0 || i + n > s.size()) return false;
        for (size_t k = 1; k < n; ++k) {
            if ((((unsigned char) s[i + k]) >> 6) != 0x2) return false;
        }
        i += n;
    }
    return true;
}

// llama-cpp-python decodes every metadata key and string value as strict UTF-8 when it loads a file.
std::string utf8_problem(const gguf_context * ctx) {
    for (int64_t i = 0; i < gguf_get_n_kv(ctx); ++i) {
        const std::string key = gguf_get_key(ctx, i);
        if (!valid_utf8(key)) return "metadata key '" + printable(key, 60) + "' is not valid UTF-8";
        if (gguf_get_kv_type(ctx, i) == GGUF_TYPE_STRING && !valid_utf8(gguf_get_val_str(ctx, i))) {
            return "metadata value of '" + printable(key, 60) + "' is not valid UTF-8";
        }
    }
    return "";
}

}  // namespace

std::string vocab_problem(const gguf_file & f) {
    const gguf_context * ctx = f.ctx();
    if (std::string problem = utf8_problem(ctx); !problem.empty()) return problem;
    const int64_t model_id = gguf_find_key(ctx, "tokenizer.ggml.model");
    if (model_id < 0) return "tokenizer.ggml.model is missing";
    if (gguf_get_kv_type(ctx, model_id) != GGUF_TYPE_STRING) return "tokenizer.ggml.model is not a string";
    const std::string model = gguf_get_val_str(ctx, model_id);
    if (model == "none" || model == "no_vocab") return "the file has no vocabulary (tokenizer.ggml.model '" + model + "')";

    const int64_t tokens_id = gguf_find_key(ctx, "tokenizer.ggml.tokens");
    if (tokens_id < 0) return "tokenizer.ggml.tokens is missing";
    std::string problem = array_of_strings_problem(ctx, tokens_id, "tokenizer.ggml.tokens");
    std::unordered_set<std::string> words;
    if (problem.empty()) problem = duplicate_token_problem(ctx, tokens_id, words);
    if (problem.empty() && model == "llama") problem = missing_byte_token_problem(words);
    if (problem.empty() && model == "rwkv") problem = rwkv_loop_problem(ctx, tokens_id);
    return problem;
}

}  // namespace pipeinfer
