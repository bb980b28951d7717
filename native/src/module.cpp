// Python bindings of the pipeinfer native layer engine (module pipeinfer_cli._native).
// The typed, documented API is pipeinfer_cli.native; this layer converts arrays, releases the GIL
// around compute and maps the C++ exceptions of errors.h to Python classes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "engine.h"
#include "errors.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <map>
#include <optional>
#include <string>

namespace py = pybind11;
using namespace pipeinfer;

namespace {

// Checks that an optional argument is a C-contiguous array of the given dtype and rank.
template <typename T>
py::array_t<T> expect_array(const py::object & obj, const char * name, int ndim) {
    if (!py::isinstance<py::array>(obj)) {
        throw invalid_input(std::string(name) + " must be a numpy array");
    }
    py::array a = py::reinterpret_borrow<py::array>(obj);
    if (!a.dtype().is(py::dtype::of<T>())) {
        throw invalid_input(std::string(name) + " must have dtype " + std::string(py::str(py::dtype::of<T>())) +
                            ", got " + std::string(py::str(a.dtype())));
    }
    if (a.ndim() != ndim) {
        throw invalid_input(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                            std::to_string(a.ndim()) + "-D");
    }
    if (!(a.flags() & py::array::c_style)) {
        throw invalid_input(std::string(name) + " must be C-contiguous (use np.ascontiguousarray)");
    }
    return py::array_t<T>(a);
}

py::array_t<float> engine_eval(layer_engine & eng, const py::object & tokens, const py::object & embd,
                               const py::object & pos, const py::object & seq_ids, const py::object & output,
                               bool batch_invariant) {
    const model_hparams & hp = eng.hparams();
    eval_batch b;
    b.invariant = batch_invariant;
    py::array_t<int32_t> tok_arr, pos_arr;
    py::array_t<float> embd_arr;
    if (!tokens.is_none() && !embd.is_none()) throw invalid_input("pass either tokens= or embd=, not both");
    if (!tokens.is_none()) {
        tok_arr = expect_array<int32_t>(tokens, "tokens", 1);
        b.n_tokens = tok_arr.shape(0);
        b.tokens = tok_arr.data();
    } else if (!embd.is_none()) {
        embd_arr = expect_array<float>(embd, "embd", 2);
        if (embd_arr.shape(1) != (py::ssize_t) hp.n_embd) {
            throw invalid_input("embd must have shape (n_tokens, n_embd=" + std::to_string(hp.n_embd) + "), got (" +
                                std::to_string(embd_arr.shape(0)) + ", " + std::to_string(embd_arr.shape(1)) + ")");
        }
        b.n_tokens = embd_arr.shape(0);
        b.embd = embd_arr.data();
    } else {
        throw invalid_input("eval needs tokens= (first stage) or embd= (later stages)");
    }
    pos_arr = expect_array<int32_t>(pos, "pos", 1);
    if (pos_arr.shape(0) != b.n_tokens) {
        throw invalid_input("pos has " + std::to_string(pos_arr.shape(0)) + " entries, expected n_tokens=" +
                            std::to_string(b.n_tokens));
    }
    b.pos = pos_arr.data();

    // seq_ids: one non-empty list of ids per token -> bit masks
    const py::sequence seqs = py::reinterpret_borrow<py::sequence>(seq_ids);
    if ((int64_t) py::len(seqs) != b.n_tokens) {
        throw invalid_input("seq_ids has " + std::to_string(py::len(seqs)) + " entries, expected n_tokens=" +
                            std::to_string(b.n_tokens));
    }
    const uint32_t n_seq_max = eng.params().n_seq_max;
    b.seqs.resize(b.n_tokens);
    for (int64_t i = 0; i < b.n_tokens; ++i) {
        uint64_t m = 0;
        auto add_id = [&](const py::handle & h) {
            const long s = h.cast<long>();
            if (s < 0 || (uint32_t) s >= n_seq_max) {
                throw invalid_input("seq id " + std::to_string(s) + " at row " + std::to_string(i) +
                                    " is out of range [0, n_seq_max=" + std::to_string(n_seq_max) + ")");
            }
            m |= 1ull << s;
        };
        const py::object row = seqs[i];
        if (PySequence_Check(row.ptr())) {
            for (const py::handle & h : py::reinterpret_borrow<py::sequence>(row)) add_id(h);
        } else {
            add_id(row);  // a bare id (int, numpy integer) stands for a one-element list
        }
        if (m == 0) throw invalid_input("row " + std::to_string(i) + " has an empty seq_ids list");
        b.seqs[i] = m;
    }

    if (eng.is_last()) {
        if (output.is_none()) {
            b.out_rows = {(int32_t) (b.n_tokens - 1)};
        } else {
            auto out_arr = expect_array<bool>(output, "output", 1);
            if (out_arr.shape(0) != b.n_tokens) {
                throw invalid_input("output has " + std::to_string(out_arr.shape(0)) + " entries, expected n_tokens=" +
                                    std::to_string(b.n_tokens));
            }
            for (int64_t i = 0; i < b.n_tokens; ++i) {
                if (out_arr.data()[i]) b.out_rows.push_back((int32_t) i);
            }
        }
    }

    eng.validate(b);
    py::array_t<float> result({(py::ssize_t) eng.out_rows(b), (py::ssize_t) eng.out_cols()});
    float * dst = result.mutable_data();
    {
        py::gil_scoped_release release;
        eng.eval(b, dst);
    }
    return result;
}

}  // namespace

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

    // Exception classes; pipeinfer_cli.native re-exports them.
    // Translators run newest first, so the subclasses are registered after their base.
    auto & exc_invalid = py::register_exception<invalid_input>(m, "NativeInputError", PyExc_ValueError);
    py::register_exception<model_file_error>(m, "ModelFileError", exc_invalid.ptr());
    py::register_exception<kv_cache_full>(m, "KVCacheFullError", exc_invalid.ptr());
    py::register_exception<eval_cancelled>(m, "EvalCancelled", PyExc_RuntimeError);

    py::class_<layer_engine>(m, "LayerEngine")
        .def(py::init([](const std::string & path, int layer_begin, int layer_end, uint32_t n_ctx, int n_threads,
                         uint32_t n_seq_max, bool use_repack, bool flash_attn) {
                 engine_params p;
                 p.path = path;
                 p.layer_begin = layer_begin;
                 p.layer_end = layer_end;
                 p.n_ctx = n_ctx;
                 p.n_threads = n_threads;
                 p.n_seq_max = n_seq_max;
                 p.use_repack = use_repack;
                 p.flash_attn = flash_attn;
                 py::gil_scoped_release release;  // loading reads hundreds of MB
                 return std::make_unique<layer_engine>(p);
             }),
             py::arg("path"), py::arg("layer_begin"), py::arg("layer_end"), py::arg("n_ctx") = 4096,
             py::arg("n_threads") = 1, py::arg("n_seq_max") = 64, py::arg("use_repack") = true,
             py::arg("flash_attn") = false)
        .def_property_readonly("arch", [](layer_engine & e) { return e.hparams().arch; })
        .def_property_readonly("n_layer", [](layer_engine & e) { return e.hparams().n_layer; })
        .def_property_readonly("layer_begin", [](layer_engine & e) { return e.weights().layer_begin; })
        .def_property_readonly("layer_end", [](layer_engine & e) { return e.weights().layer_end; })
        .def_property_readonly("n_embd", [](layer_engine & e) { return e.hparams().n_embd; })
        .def_property_readonly("n_vocab", [](layer_engine & e) { return e.hparams().n_vocab; })
        .def_property_readonly("n_ctx", [](layer_engine & e) { return e.params().n_ctx; })
        .def_property_readonly("n_seq_max", [](layer_engine & e) { return e.params().n_seq_max; })
        .def_property_readonly("n_threads", [](layer_engine & e) { return e.params().n_threads; })
        .def_property_readonly("flash_attn", [](layer_engine & e) { return e.params().flash_attn; })
        .def_property_readonly("is_first", &layer_engine::is_first)
        .def_property_readonly("is_last", &layer_engine::is_last)
        .def_property_readonly("weight_bytes", [](layer_engine & e) { return e.weights().weight_bytes; })
        .def_property_readonly("n_repacked", [](layer_engine & e) { return e.weights().n_repacked; })
        .def_property_readonly("kv_bytes", &layer_engine::kv_bytes)
        .def("hparams", [](layer_engine & e) {
            const model_hparams & h = e.hparams();
            py::dict d;
            d["arch"] = h.arch; d["n_layer"] = h.n_layer; d["n_embd"] = h.n_embd; d["n_head"] = h.n_head;
            d["n_head_kv"] = h.n_head_kv; d["n_embd_head"] = h.n_embd_head; d["n_ff"] = h.n_ff;
            d["n_vocab"] = h.n_vocab; d["n_ctx_train"] = h.n_ctx_train; d["f_norm_rms_eps"] = h.f_norm_rms_eps;
            d["rope_type"] = h.rope_type; d["rope_freq_base"] = h.rope_freq_base;
            d["rope_freq_scale"] = h.rope_freq_scale;
            return d;
        })
        .def("eval", &engine_eval, py::arg("tokens") = py::none(), py::arg("embd") = py::none(),
             py::arg("pos"), py::arg("seq_ids"), py::arg("output") = py::none(),
             py::arg("batch_invariant") = false)
        .def("cancel", &layer_engine::cancel)
        .def("clear_cancel", &layer_engine::clear_cancel)
        .def("cancel_requested", &layer_engine::cancel_requested)
        .def("eval_progress", &layer_engine::eval_progress)
        .def("seq_rm", &layer_engine::seq_rm, py::arg("seq_id"), py::arg("p0") = -1, py::arg("p1") = -1)
        .def("seq_cp", &layer_engine::seq_cp, py::arg("src"), py::arg("dst"), py::arg("p0") = -1, py::arg("p1") = -1)
        .def("seq_cp_many", &layer_engine::seq_cp_many, py::arg("src"), py::arg("dsts"), py::arg("p0") = -1,
             py::arg("p1") = -1)
        .def("seq_keep", &layer_engine::seq_keep, py::arg("seq_id"))
        .def("seq_pos_max", &layer_engine::seq_pos_max, py::arg("seq_id"))
        .def("seq_pos_min", &layer_engine::seq_pos_min, py::arg("seq_id"))
        .def("kv_clear", &layer_engine::kv_clear)
        .def("kv_used_cells", &layer_engine::kv_used_cells)
        .def("stats", [](layer_engine & e) {
            const engine_stats s = e.stats();
            py::dict d;
            d["evals"] = s.evals;
            d["evals_cancelled"] = s.evals_cancelled;
            d["cancelled_mid_compute"] = s.cancelled_mid_compute;
            d["layer_evals"] = s.layer_evals;
            d["layer_evals_skipped"] = s.layer_evals_skipped;
            d["t_compute_us"] = s.t_compute_us;
            return d;
        });
}
