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
    return problem;
}

}  // namespace pipeinfer
