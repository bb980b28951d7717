// ggml's CPU backend through the backend registry, never through ggml-cpu's own symbols, so the
// extension runs on either build of ggml that llama-cpp-python installs:
//   - one CPU backend linked into libggml (GGML_NATIVE, or portable): it is registered already;
//   - every x86 variant as its own library (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, as llama.cpp's
//     release builds): libggml-cpu-<variant>.so next to libggml.so, loaded here, the one whose
//     ggml_backend_score is highest on this CPU, or the one PIPEINFER_GGML_CPU names.
#pragma once

#include "ggml-backend.h"

#include <map>
#include <string>
#include <vector>

namespace pipeinfer {

// The CPU device; the first call loads the CPU backend when none is registered (thread-safe).
// Throws invalid_input for a PIPEINFER_GGML_CPU this install or this CPU cannot run,
// engine_failure when ggml finds no CPU backend at all.
ggml_backend_dev_t cpu_device();

// A CPU backend with n_threads threads and an abort callback (the registry's CPU proc addresses).
ggml_backend_t cpu_backend_new(int n_threads, ggml_abort_callback abort_cb, void * abort_data);

// Whether ggml's CPU kernels have a dot product for weights of this type (MUL_MAT's src0).
bool cpu_has_vec_dot(ggml_type type);

struct cpu_backend_info {
    std::string variant;   // "zen4", "haswell", ...; "builtin" when libggml carries the CPU backend itself
    std::string library;   // the file the CPU backend's code lives in
    bool dynamic = false;  // loaded at run time (GGML_BACKEND_DL)
    std::string forced;    // PIPEINFER_GGML_CPU, when it chose the variant
    std::vector<std::string> available;  // the variants installed beside libggml (dynamic builds)
    std::map<std::string, std::string> features;  // ggml_backend_get_features: "AVX2" -> "1", ...
};

// Which CPU backend this process computes with (loads it first, as cpu_device()).
cpu_backend_info cpu_backend_describe();

}  // namespace pipeinfer
