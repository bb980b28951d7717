"""The extension and llama_cpp map the same ggml files whichever is imported first."""

import subprocess
import sys

import pytest

SNIPPET = """
{imports}
print(sorted({{line.split()[-1] for line in open('/proc/self/maps') if 'libggml' in line}}))
"""


@pytest.mark.parametrize("imports", ["from pipeinfer_cli import _native\nimport llama_cpp",
                                     "import llama_cpp\nfrom pipeinfer_cli import _native"])
def test_one_ggml_directory_in_either_import_order(imports):
    out = subprocess.run([sys.executable, "-c", SNIPPET.format(imports=imports)], check=True,
                         capture_output=True, text=True).stdout
    libs = eval(out)  # noqa: S307 - our own printed list
    assert len({lib.rsplit("/", 1)[0] for lib in libs}) == 1, libs
    assert len([lib for lib in libs if "libggml-base" in lib]) == 1, libs
