// Python bindings of the pipeinfer native layer engine (module pipeinfer_cli._native).
// The typed, documented API is pipeinfer_cli.native; this layer only converts Python objects to
// the C++ types (layer_engine validates them), releases the GIL around loading and compute, and
// maps the C++ exceptions of errors.h to Python classes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu_backend.h"
#include "engine.h"
#include "errors.h"
#include "gguf_file.h"
#include "gguf_slice.h"
#include "vocab_check.h"

#include "ggml.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace py = pybind11;
using namespace pipeinfer;

namespace {

// report_sigill(): the line written to stderr when the process dies of SIGILL. A fixed buffer and
// write(2): all the handler does is async-signal-safe; it then dies of SIGILL as it would have.
char g_sigill_line[1024];
size_t g_sigill_len = 0;

void on_sigill(int sig) {
    if (g_sigill_len > 0) {
        ssize_t r = write(STDERR_FILENO, g_sigill_line, g_sigill_len);
        (void) r;
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

// Arrays arrive C-contiguous in the C++ type (pybind11 converts when it must); checking their
// shapes and values is layer_engine::validate's job.
template <typename T>
using c_array = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
array_view<T> view_of(const std::optional<c_array<T>> & a) {
    array_view<T> v;
    if (!a) return v;
    v.data = a->data();
    v.shape.assign(a->shape(), a->shape() + a->ndim());
    return v;
}

// seq_ids: per token a sequence of ids, or a bare id (int, numpy integer) for a one-element list
// -> llama_batch's layout: a count per token and the ids one after the other.
void convert_seq_ids(const py::sequence & seq_ids, eval_batch & b) {
    b.n_seq_id.reserve(py::len(seq_ids));
    for (const py::handle & row : seq_ids) {
        if (PySequence_Check(row.ptr())) {
            const py::sequence ids = py::reinterpret_borrow<py::sequence>(row);
            b.n_seq_id.push_back((int32_t) py::len(ids));
            for (const py::handle & h : ids) b.seq_id.push_back(h.cast<long long>());
        } else {
            b.n_seq_id.push_back(1);
            b.seq_id.push_back(row.cast<long long>());
        }
    }
}

py::array_t<float> engine_eval(layer_engine & eng, const std::optional<c_array<int32_t>> & tokens,
                               const std::optional<c_array<float>> & embd, const std::optional<c_array<int32_t>> & pos,
                               const py::sequence & seq_ids, const std::optional<c_array<bool>> & output,
                               bool batch_invariant) {
    eval_batch b;
    b.tokens = view_of(tokens);
    b.embd = view_of(embd);
    b.pos = view_of(pos);
    convert_seq_ids(seq_ids, b);
    b.output = view_of(output);
    b.invariant = batch_invariant;

    const checked_batch cb = eng.validate(b);
    py::array_t<float> result({(py::ssize_t) eng.out_rows(cb), (py::ssize_t) eng.out_cols()});
    float * dst = result.mutable_data();
    {
        py::gil_scoped_release release;
        eng.eval(cb, dst);
    }
    return result;
}

// Text from a GGUF file as a Python str: the file may hold any bytes, so invalid UTF-8 becomes U+FFFD.
py::object lossy_str(const char * v) {
    return py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(v, (py::ssize_t) std::strlen(v), "replace"));
}

// A GGUF value as a Python object; an array gives its length (its elements are not read).
py::object gguf_value(const gguf_context * ctx, int64_t id) {
    switch (gguf_get_kv_type(ctx, id)) {
        case GGUF_TYPE_UINT8:   return py::int_(gguf_get_val_u8(ctx, id));
        case GGUF_TYPE_INT8:    return py::int_(gguf_get_val_i8(ctx, id));
        case GGUF_TYPE_UINT16:  return py::int_(gguf_get_val_u16(ctx, id));
        case GGUF_TYPE_INT16:   return py::int_(gguf_get_val_i16(ctx, id));
        case GGUF_TYPE_UINT32:  return py::int_(gguf_get_val_u32(ctx, id));
        case GGUF_TYPE_INT32:   return py::int_(gguf_get_val_i32(ctx, id));
        case GGUF_TYPE_UINT64:  return py::int_(gguf_get_val_u64(ctx, id));
        case GGUF_TYPE_INT64:   return py::int_(gguf_get_val_i64(ctx, id));
        case GGUF_TYPE_FLOAT32: return py::float_(gguf_get_val_f32(ctx, id));
        case GGUF_TYPE_FLOAT64: return py::float_(gguf_get_val_f64(ctx, id));
        case GGUF_TYPE_BOOL:    return py::bool_(gguf_get_val_bool(ctx, id));
        case GGUF_TYPE_ARRAY:   return py::int_(gguf_get_arr_n(ctx, id));
        case GGUF_TYPE_STRING:  return lossy_str(gguf_get_val_str(ctx, id));
        default: return py::none();
    }
}

// Header, key/values and tensor table of a GGUF file, without reading tensor data.
py::dict gguf_metadata(const std::string & path) {
    std::unique_ptr<gguf_file> f;
    {
        py::gil_scoped_release release;
        f = std::make_unique<gguf_file>(path, /*with_tensor_meta=*/ false);
    }
    const gguf_context * ctx = f->ctx();
    py::dict kv;
    for (int64_t i = 0; i < gguf_get_n_kv(ctx); ++i) kv[lossy_str(gguf_get_key(ctx, i))] = gguf_value(ctx, i);
    py::list tensors;
    const size_t base = gguf_get_data_offset(ctx);
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        std::string type = ggml_type_name(gguf_get_tensor_type(ctx, i));
        for (char & c : type) c = (char) std::toupper((unsigned char) c);
        tensors.append(py::make_tuple(lossy_str(gguf_get_tensor_name(ctx, i)), type, base + gguf_get_tensor_offset(ctx, i),
                                      gguf_get_tensor_size(ctx, i)));
    }
    py::dict d;
    d["file_size"] = f->file_size();
    d["kv"] = kv;
    d["tensors"] = tensors;
    return d;
}

void bind_functions(py::module_ & m) {
    m.def("report_sigill", [](const std::string & line) {
        g_sigill_len = std::min(line.size(), sizeof(g_sigill_line));
        std::memcpy(g_sigill_line, line.data(), g_sigill_len);
        struct sigaction sa {};
        sa.sa_handler = on_sigill;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_NODEFER;
        sigaction(SIGILL, &sa, nullptr);
    }, py::arg("line"),
          "On SIGILL (an instruction this CPU does not run, e.g. ggml's AMX kernels where AMX is not "
          "enabled), write `line` to stderr, then die of SIGILL as before.");

    m.def("ggml_version", []() { return std::string(ggml_version()); },
          "Version string of the ggml library this extension is linked against.");

    m.def("supported_archs", []() { return py::tuple(py::cast(supported_archs())); },
          "Architectures (general.architecture) the layer engine computes.");

    m.def("gguf_metadata", &gguf_metadata, py::arg("path"),
          "{'file_size', 'kv': {key: value (an array: its length)}, 'tensors': [(name, TYPE, offset, bytes)]} "
          "of a GGUF file, read with ggml's reader without the tensor data.");

    m.def("gguf_vocab_problem", [](const std::string & path) {
        py::gil_scoped_release release;
        const gguf_file f(path, /*with_tensor_meta=*/ false);
        return vocab_problem(f);
    }, py::arg("path"),
          "What in a GGUF file's vocabulary would make llama.cpp's loader abort ('' when nothing); "
          "raises ModelFileError when the header itself does not parse.");

    m.def("gguf_slice_layout", [](const std::string & path, const std::vector<std::string> & names,
                                  const std::string & source_sha256, uint32_t layer_begin, uint32_t layer_end) {
        slice_layout layout;
        {
            py::gil_scoped_release release;
            layout = plan_slice(path, names, source_sha256, layer_begin, layer_end);
        }
        py::list pieces;
        for (const auto & p : layout.pieces) pieces.append(py::make_tuple(p.src_offset, p.size, p.dst_offset));
        return py::make_tuple(py::bytes((const char *) layout.meta.data(), layout.meta.size()), pieces,
                              layout.total_size);
    }, py::arg("path"), py::arg("tensor_names"), py::arg("source_sha256"), py::arg("layer_begin"), py::arg("layer_end"),
          "(meta bytes, [(src_offset, size, dst_offset)], total size) of a rank slice of a GGUF file: every "
          "key/value, pipeinfer.slice.* keys, and only the named tensors (gguf_slice.h).");

    m.def("cpu_features", []() {
        cpu_backend_info info;
        {
            py::gil_scoped_release release;
            info = cpu_backend_describe();
        }
        std::map<std::string, bool> f;
        for (const char * name : {"avx", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "fma", "f16c"}) {
            std::string key = name;
            for (char & c : key) c = (char) std::toupper((unsigned char) c);
            f[name] = info.features.count(key) && info.features.at(key) == "1";
        }
        return f;
    }, "x86 features that ggml's CPU backend (the variant this process computes with) is built for.");

    m.def("cpu_backend", []() {
        cpu_backend_info info;
        {
            py::gil_scoped_release release;
            info = cpu_backend_describe();
        }
        py::dict d;
        d["variant"] = info.variant;
        d["library"] = info.library;
        d["dynamic"] = info.dynamic;
        d["forced"] = info.forced.empty() ? py::object(py::none()) : py::object(py::str(info.forced));
        d["available"] = info.available;
        d["features"] = info.features;
        return d;
    }, "The CPU backend this process computes with, loaded first when none is (ggml's backend registry): "
       "{'variant' ('zen4', ..., or 'builtin'), 'library', 'dynamic', 'forced' (PIPEINFER_GGML_CPU or None), "
       "'available' (variants installed), 'features' (ggml_backend_get_features)}.");
}

void bind_exceptions(py::module_ & m) {
    // Exception classes; pipeinfer_cli.native re-exports them.
    // Translators run newest first, so the subclasses are registered after their base.
    auto & exc_invalid = py::register_exception<invalid_input>(m, "NativeInputError", PyExc_ValueError);
    py::register_exception<model_file_error>(m, "ModelFileError", exc_invalid.ptr());
    py::register_exception<kv_cache_full>(m, "KVCacheFullError", exc_invalid.ptr());
    py::register_exception<eval_cancelled>(m, "EvalCancelled", PyExc_RuntimeError);
}

// LayerEngine's constructor and read-only properties.
void bind_engine_properties(py::class_<layer_engine> & c) {
    c.def(py::init([](const std::string & path, int layer_begin, int layer_end, int64_t n_ctx, int n_threads,
                         int64_t n_seq_max, bool use_repack, bool flash_attn, bool swa_full, int64_t n_slots) {
                 engine_params p;
                 p.path = path;
                 p.layer_begin = layer_begin;
                 p.layer_end = layer_end;
                 p.n_ctx = n_ctx;
                 p.n_threads = n_threads;
                 p.n_seq_max = n_seq_max;
                 p.use_repack = use_repack;
                 p.flash_attn = flash_attn;
                 p.swa_full = swa_full;
                 p.n_slots = n_slots;
                 py::gil_scoped_release release;  // loading reads hundreds of MB
                 return std::make_unique<layer_engine>(p);
             }),
             py::arg("path"), py::arg("layer_begin"), py::arg("layer_end"), py::arg("n_ctx") = 4096,
             py::arg("n_threads") = 1, py::arg("n_seq_max") = 64, py::arg("use_repack") = true,
             py::arg("flash_attn") = false, py::arg("swa_full") = false, py::arg("n_slots") = 1)
        .def_property_readonly("arch", [](layer_engine & e) { return e.hparams().arch; })
        .def_property_readonly("n_layer", [](layer_engine & e) { return e.hparams().n_layer; })
        .def_property_readonly("layer_begin", [](layer_engine & e) { return e.weights().layer_begin; })
        .def_property_readonly("layer_end", [](layer_engine & e) { return e.weights().layer_end; })
        .def_property_readonly("n_embd", [](layer_engine & e) { return e.hparams().n_embd; })
        .def_property_readonly("n_vocab", [](layer_engine & e) { return e.hparams().n_vocab; })
        .def_property_readonly("n_ctx", [](layer_engine & e) { return e.params().n_ctx; })
        .def_property_readonly("n_seq_max", [](layer_engine & e) { return e.params().n_seq_max; })
        .def_property_readonly("n_slots", [](layer_engine & e) { return e.params().n_slots; })
        .def_property_readonly("n_threads", [](layer_engine & e) { return e.params().n_threads; })
        .def_property_readonly("flash_attn", [](layer_engine & e) { return e.params().flash_attn; })
        .def_property_readonly("is_first", &layer_engine::is_first)
        .def_property_readonly("is_last", &layer_engine::is_last)
        .def_property_readonly("weight_bytes", [](layer_engine & e) { return e.weights().weight_bytes; })
        .def_property_readonly("n_repacked", [](layer_engine & e) { return e.weights().n_repacked; })
        .def_property_readonly("expert_bytes", [](layer_engine & e) { return e.weights().expert_bytes; })
        .def_property_readonly("kv_bytes", &layer_engine::kv_bytes)
        .def_property_readonly("kv_swa_size", &layer_engine::kv_swa_size);
}

// LayerEngine's methods: hparams, eval, cancel, KV cache operations, stats.
void bind_engine_methods(py::class_<layer_engine> & c) {
    c.def("hparams", [](layer_engine & e) {
            const model_hparams & h = e.hparams();
            py::dict d;
            d["arch"] = h.arch; d["n_layer"] = h.n_layer; d["n_embd"] = h.n_embd; d["n_head"] = h.n_head;
            d["n_head_kv"] = h.n_head_kv; d["n_embd_head"] = h.n_embd_head; d["n_ff"] = h.n_ff;
            d["n_vocab"] = h.n_vocab; d["n_ctx_train"] = h.n_ctx_train; d["f_norm_rms_eps"] = h.f_norm_rms_eps;
            d["rope_type"] = h.rope_type; d["rope_freq_base"] = h.rope_freq_base;
            d["rope_freq_scale"] = h.rope_freq_scale;
            d["n_expert"] = h.n_expert; d["n_expert_used"] = h.n_expert_used; d["n_ff_exp"] = h.n_ff_exp;
            d["n_swa"] = h.n_swa;  // sliding window of the local layers (gemma3), 0 = none
            std::vector<int> swa_layers;
            for (uint32_t il = 0; il < h.n_layer; ++il) if (h.is_swa((int) il)) swa_layers.push_back((int) il);
            d["swa_layers"] = swa_layers;
            return d;
        })
        .def("eval", &engine_eval, py::arg("tokens") = py::none(), py::arg("embd") = py::none(),
             py::arg("pos") = py::none(), py::arg("seq_ids"), py::arg("output") = py::none(),
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
        .def("kv_swa_used_cells", &layer_engine::kv_swa_used_cells)
        .def("kv_min_resume", &layer_engine::kv_min_resume, py::arg("seq_id"))
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

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "pipeinfer native layer engine, built on the ggml installed by llama-cpp-python";
    bind_functions(m);
    bind_exceptions(m);
    py::class_<layer_engine> engine(m, "LayerEngine");
    bind_engine_properties(engine);
    bind_engine_methods(engine);
}
