#pragma once

#include "ggml-backend.h"

namespace pipeinfer {

// Asks the kernel to back a host buffer with transparent huge pages (madvise MADV_HUGEPAGE on the
// 2 MiB-aligned part of it), before anything touches its pages. Under the common THP setting
// "madvise", large buffers get none otherwise, and every token's pass over the weights then walks
// hundreds of thousands of 4 KiB page-table entries. A no-op for buffers outside this process's
// memory (a GPU's), on kernels without THP, or with PIPEINFER_HUGEPAGES=0 (for side-by-side
// measurements).
void advise_huge_pages(ggml_backend_buffer_t buf);

}  // namespace pipeinfer
