#include "huge_pages.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pipeinfer {

namespace {

bool enabled() {
    static const bool on = [] {
        const char * v = std::getenv("PIPEINFER_HUGEPAGES");
        return !(v && std::strcmp(v, "0") == 0);
    }();
    return on;
}

// Plain host buffers and the CPU's extra buffer types (repacked weights): memory of this process.
bool in_cpu_memory(ggml_backend_buffer_t buf) {
    if (ggml_backend_buffer_is_host(buf)) return true;
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
    return dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

}  // namespace

void advise_huge_pages(ggml_backend_buffer_t buf) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (!buf || !enabled() || !in_cpu_memory(buf)) return;
    constexpr uintptr_t huge = uintptr_t(2) << 20;
    const auto begin = reinterpret_cast<uintptr_t>(ggml_backend_buffer_get_base(buf));
    const uintptr_t end = begin + ggml_backend_buffer_get_size(buf);
    const uintptr_t lo = (begin + huge - 1) & ~(huge - 1), hi = end & ~(huge - 1);
    if (hi <= lo) return;  // smaller than one huge page once aligned
    // Advice only: if the kernel refuses (THP off, an old kernel), the buffer keeps 4 KiB pages.
    (void) madvise(reinterpret_cast<void *>(lo), hi - lo, MADV_HUGEPAGE);
#else
    (void) buf;
#endif
}

}  // namespace pipeinfer
