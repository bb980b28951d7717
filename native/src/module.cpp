// Python bindings of the pipeinfer native layer engine.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ggml.h"
#include "ggml-cpu.h"

#include <map>
#include <string>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
    m.doc() = "pipeinfer native layer engine, built on the ggml installed by llama-cpp-python";

    m.def("ggml_version", []() { return std::string(ggml_version()); },
          "Version string of the ggml library this extension is linked against.");

    m.def("cpu_features", []() {
        std::map<std::string, bool> f;
        f["avx"]         = ggml_cpu_has_avx();
        f["avx2"]        = ggml_cpu_has_avx2();
        f["avx512"]      = ggml_cpu_has_avx512();
        f["avx512_vnni"] = ggml_cpu_has_avx512_vnni();
        f["avx512_bf16"] = ggml_cpu_has_avx512_bf16();
        f["fma"]         = ggml_cpu_has_fma();
        f["f16c"]        = ggml_cpu_has_f16c();
        return f;
    }, "CPU features that ggml's CPU backend detects on this machine.");
}
