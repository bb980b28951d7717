#include "cpu_backend.h"

#include "errors.h"
#include "gguf_file.h"  // quiet_ggml_log
#include "ggml-cpu.h"  // struct ggml_type_traits_cpu only: every ggml-cpu function is looked up at run time

#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace pipeinfer {

namespace {

const char * const variant_prefix = "libggml-cpu-";
const char * const variant_suffix = ".so";

std::mutex g_mutex;
bool g_loaded = false;
std::string g_forced;

std::string dir_of(const std::string & file) {
    const size_t slash = file.rfind('/');
    return slash == std::string::npos ? std::string(".") : file.substr(0, slash);
}

// The file a code or data address belongs to ("" when dladdr cannot tell).
std::string library_of(const void * addr) {
    Dl_info info {};
    if (!dladdr(addr, &info) || !info.dli_fname) return "";
    return info.dli_fname;
}

// The directory libggml.so was loaded from: the CPU variants are installed beside it.
std::string ggml_dir() {
    return dir_of(library_of((const void *) &ggml_backend_load_all_from_path));
}

// "zen4" for .../libggml-cpu-zen4.so, "" for any other file name.
std::string variant_of(const std::string & path) {
    const std::string name = path.substr(path.rfind('/') + 1);
    const size_t np = std::strlen(variant_prefix), ns = std::strlen(variant_suffix);
    if (name.size() <= np + ns || name.compare(0, np, variant_prefix) != 0 ||
        name.compare(name.size() - ns, ns, variant_suffix) != 0) {
        return "";
    }
    return name.substr(np, name.size() - np - ns);
}

std::vector<std::string> installed_variants(const std::string & dir) {
    std::vector<std::string> out;
    if (DIR * d = opendir(dir.c_str())) {
        while (const dirent * e = readdir(d)) {
            const std::string v = variant_of(e->d_name);
            if (!v.empty()) out.push_back(v);
        }
        closedir(d);
    }
    std::sort(out.begin(), out.end());
    return out;
}

std::string joined(const std::vector<std::string> & items) {
    std::string s;
    for (const auto & i : items) s += (s.empty() ? "" : ", ") + i;
    return s.empty() ? "none" : s;
}

// ggml_backend_score of a variant's library on this CPU (0: it does not run here), without registering it.
int variant_score(const std::string & path) {
    void * h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) throw engine_failure("cannot load " + path + ": " + dlerror());
    auto score = (int (*)()) dlsym(h, "ggml_backend_score");
    const int s = score ? score() : 0;
    dlclose(h);
    return s;
}

// Registers the variant PIPEINFER_GGML_CPU names, after checking that this CPU runs it.
void load_forced(const std::string & dir, const std::string & variant) {
    const std::string path = dir + "/" + variant_prefix + variant + variant_suffix;
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) {
        const std::vector<std::string> have = installed_variants(dir);
        throw invalid_input("PIPEINFER_GGML_CPU=" + variant + ": no such ggml CPU variant in " + dir +
                            (have.empty() ? std::string(" (this ggml has one CPU backend built in; `make install "
                                                        "GGML_CPU=all` builds every variant)")
                                          : " (installed: " + joined(have) + ")"));
    }
    if (variant_score(path) == 0) {
        throw invalid_input("PIPEINFER_GGML_CPU=" + variant + ": this CPU lacks instructions that variant needs "
                            "(its ggml_backend_score is 0); installed: " + joined(installed_variants(dir)));
    }
    if (!ggml_backend_load(path.c_str())) throw engine_failure("ggml could not register " + path);
}

void load_cpu_backend_locked() {
    if (g_loaded) return;
    const char * env = std::getenv("PIPEINFER_GGML_CPU");
    const std::string forced = env ? env : "";
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    const std::string dir = ggml_dir();
    if (!dev) {
        quiet_ggml_log quiet;  // ggml says "loaded CPU backend from ..." at INFO level; warnings and errors pass
        if (!forced.empty()) {
            load_forced(dir, forced);
        } else {
            ggml_backend_load_all_from_path(dir.c_str());
        }
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (!dev) {
            throw engine_failure("ggml found no CPU backend this CPU runs in " + dir + " (installed variants: " +
                                 joined(installed_variants(dir)) + ")");
        }
    } else if (!forced.empty()) {
        const std::string have = variant_of(library_of(ggml_backend_dev_backend_reg(dev)));
        if (have != forced) {
            throw invalid_input("PIPEINFER_GGML_CPU=" + forced + ": this process computes with " +
                                (have.empty() ? std::string("the CPU backend built into ggml (one build for this "
                                                            "CPU; `make install GGML_CPU=all` builds every variant)")
                                              : "the variant " + have + ", loaded before") );
        }
    }
    g_forced = forced;
    g_loaded = true;
}

void * cpu_proc(const char * name) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu_device());
    if (void * p = ggml_backend_reg_get_proc_address(reg, name)) return p;
    // Not offered through the registry by this ggml: the CPU library exports it under a name of its own.
    const std::string lib = library_of(reg);
    void * h = lib.empty() ? nullptr : dlopen(lib.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (!h) return nullptr;
    const std::string cpu_name = std::string("ggml_backend_cpu_") + (name + std::strlen("ggml_backend_"));
    void * p = dlsym(h, cpu_name.c_str());
    dlclose(h);
    return p;
}

}  // namespace

ggml_backend_dev_t cpu_device() {
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        load_cpu_backend_locked();
    }
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
}

ggml_backend_t cpu_backend_new(int n_threads, ggml_abort_callback abort_cb, void * abort_data) {
    ggml_backend_t backend = ggml_backend_dev_init(cpu_device(), nullptr);
    if (!backend) throw engine_failure("ggml could not start its CPU backend");
    auto set_threads = (ggml_backend_set_n_threads_t) cpu_proc("ggml_backend_set_n_threads");
    auto set_abort = (ggml_backend_set_abort_callback_t) cpu_proc("ggml_backend_set_abort_callback");
    if (!set_threads || !set_abort) {
        ggml_backend_free(backend);
        throw engine_failure("ggml's CPU backend offers no ggml_backend_set_n_threads or ggml_backend_set_abort_callback");
    }
    set_threads(backend, n_threads);
    set_abort(backend, abort_cb, abort_data);
    return backend;
}

bool cpu_has_vec_dot(ggml_type type) {
    static std::once_flag once;
    static const ggml_type_traits_cpu * (*traits)(ggml_type) = nullptr;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu_device());
    std::call_once(once, [reg] {
        const std::string lib = library_of(reg);
        if (void * h = lib.empty() ? nullptr : dlopen(lib.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
            traits = (const ggml_type_traits_cpu * (*)(ggml_type)) dlsym(h, "ggml_get_type_traits_cpu");
            dlclose(h);  // still loaded: the registry holds it
        }
    });
    if (!traits) throw engine_failure("ggml's CPU backend exports no ggml_get_type_traits_cpu");
    return traits(type)->vec_dot != nullptr;
}

cpu_backend_info cpu_backend_describe() {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu_device());
    cpu_backend_info info;
    info.library = library_of(reg);
    info.variant = variant_of(info.library);
    info.dynamic = !info.variant.empty();
    if (!info.dynamic) info.variant = "builtin";
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        info.forced = g_forced;
    }
    info.available = installed_variants(ggml_dir());
    auto get_features = (ggml_backend_get_features_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features");
    if (get_features) {
        for (ggml_backend_feature * f = get_features(reg); f && f->name; ++f) info.features[f->name] = f->value;
    }
    return info;
}

}  // namespace pipeinfer
