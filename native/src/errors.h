// Typed exceptions of the native engine. module.cpp maps each to a Python exception class, so a
// bad input or a cancelled eval never reaches GGML_ASSERT (which would abort the process).
#pragma once

#include <stdexcept>
#include <string>

namespace pipeinfer {

// Invalid argument or unusable model file (maps to ValueError).
struct invalid_input : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// The model file is unreadable, truncated or not a GGUF file (maps to ModelFileError(ValueError)).
struct model_file_error : invalid_input {
    using invalid_input::invalid_input;
};

// A batch needs more free KV cells than the cache has (maps to KVCacheFullError(ValueError)).
struct kv_cache_full : invalid_input {
    using invalid_input::invalid_input;
};

// The eval saw the cancel flag and stopped; the cells it claimed were freed (maps to EvalCancelled).
struct eval_cancelled : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// ggml itself failed (allocation or compute status); not the caller's fault (maps to RuntimeError).
struct engine_failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

}  // namespace pipeinfer
