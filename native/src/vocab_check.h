// Checks a GGUF file's vocabulary for what llama.cpp's vocabulary loader asserts on (GGML_ASSERT
// aborts the process) instead of reporting: the head's tokenizer calls this before handing the
// file to llama.cpp, so that a malformed vocabulary ends in an error message, not an abort.
#pragma once

#include "gguf_file.h"

#include <string>

namespace pipeinfer {

// Empty when llama.cpp may load the vocabulary; otherwise what is wrong, for an error message.
// Checked: tokenizer.ggml.model is a string naming a vocabulary (not "none"/"no_vocab", which
// leaves llama.cpp without a tokenizer); tokenizer.ggml.tokens is a non-empty array of strings of
// at most INT32_MAX entries, without duplicates (llama.cpp maps text -> id and asserts that no
// two ids share a text; it renames an empty token "[EMPTY_<id>]" first, and so does this check);
// every metadata key and string value is valid UTF-8 (llama-cpp-python decodes them strictly).
std::string vocab_problem(const gguf_file & f);

}  // namespace pipeinfer
