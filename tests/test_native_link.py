"""The C++ extension is built and linked against the ggml that llama-cpp-python installs."""

import re


def test_native_reports_ggml_version():
    from pipeinfer_cli import _native

    assert re.fullmatch(r"\d+\.\d+\.\d+.*", _native.ggml_version())
    feats = _native.cpu_features()
    assert isinstance(feats["avx2"], bool)


def test_one_ggml_in_the_process():
    import llama_cpp  # noqa: F401  (loads its ggml)
    from pipeinfer_cli import _native  # noqa: F401

    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libggml-base" in line}
    assert len(libs) == 1, libs
