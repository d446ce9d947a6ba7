"""The ops package without the compiled extension: import works, references run, one notice; the op
tests skip then, and fail instead under MEGATRON_SP_REQUIRE_EXTENSION=1 (as scripts/test.sh runs them)."""

import os
import subprocess
import sys

import pytest
import torch
from launch_helpers import REPO

from megatron_sp.testing import extension_missing

NO_EXTENSION = r"""
import sys, logging, torch
sys.modules["megatron_sp._C"] = None          # makes `import megatron_sp._C` raise ImportError
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
from megatron_sp import ops
from megatron_sp.ops.philox import default_index
assert not ops.extension_available()
x, w, b = torch.randn(4, 2, 8), torch.ones(8), torch.zeros(8)
ops.layer_norm(x, w, b, 1e-5)
ops.dropout_add(x, b, x, 0.1, 1, 0, 2, default_index(4, 2))
ops.zigzag_reorder(x, 2)
w = torch.randn(8)
assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6))
print("OK")
"""


def test_import_and_ops_work_without_extension():
    proc = subprocess.run([sys.executable, "-c", NO_EXTENSION], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"
    notices = [line for line in proc.stderr.splitlines() if "megatron_sp._C is not available" in line]
    assert len(notices) == 1, proc.stderr


@pytest.mark.extension
def test_extension_builds_cpu_kernels():
    # scripts/env.sh builds the extension; when it is present its CPU kernels must be registered.
    from megatron_sp.ops._extension import BUILT_DEVICES

    assert "cpu" in BUILT_DEVICES
    for name in ("dropout_add_fwd", "layer_norm_bwd", "rms_norm_fwd", "zigzag_reorder", "flash_attention_bwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_sp::{name}", "CPU"), name


@pytest.mark.extension
def test_extension_missing_says_why(monkeypatch):
    from megatron_sp.ops import _extension

    assert extension_missing() == "" and extension_missing("layer_norm_fwd") == ""
    assert extension_missing("no_such_op") == "megatron_sp._C has no no_such_op (built from older sources)"
    monkeypatch.setattr(_extension, "_LOAD_ERROR", "ImportError: libc10.so: cannot open shared object file")
    assert extension_missing() == "megatron_sp._C did not load (ImportError: libc10.so: cannot open shared object file)"


# pytest in a process where megatron_sp._C does not load: the test needing it must fail, not skip.
REQUIRED_BUT_HIDDEN = r"""
import sys
import pytest
sys.modules["megatron_sp._C"] = None          # makes `import megatron_sp._C` raise ImportError
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "{test}::test_extension_builds_cpu_kernels"]))
"""


def test_required_extension_fails_the_op_tests_when_missing():
    env = dict(os.environ, MEGATRON_SP_REQUIRE_EXTENSION="1")
    proc = subprocess.run(
        [sys.executable, "-c", REQUIRED_BUT_HIDDEN.format(test=__file__)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 error" in proc.stdout and "skipped" not in proc.stdout, proc.stdout
    assert "megatron_sp._C did not load (ModuleNotFoundError: import of megatron_sp._C halted" in proc.stdout
    assert "MEGATRON_SP_REQUIRE_EXTENSION=1 requires it: rebuild it with" in proc.stdout, proc.stdout


def _setup_cuda_home():
    """setup.py's _cuda_home, taken out of the file (importing setup.py would run setup())."""
    import ast
    import glob

    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    (func,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_cuda_home"]
    namespace = {"os": os, "glob": glob}
    exec(compile(ast.Module([func], []), "setup.py", "exec"), namespace)
    return namespace["_cuda_home"]


def test_setup_finds_the_cuda_toolkit_behind_nvcc(tmp_path, monkeypatch):
    """torch guesses CUDA_HOME as nvcc's directory's parent; setup.py looks behind a symlinked nvcc
    for the toolkit with cuda_runtime.h, and behind a wrapper script never takes the wrong guess."""
    cuda_home = _setup_cuda_home()
    toolkit = tmp_path / "cuda-99.0"
    (toolkit / "bin").mkdir(parents=True), (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    on_path = tmp_path / "local" / "bin"
    on_path.mkdir(parents=True)
    (on_path / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    monkeypatch.setenv("PATH", str(on_path))
    assert cuda_home() == str(toolkit)
    (on_path / "nvcc").unlink()  # a wrapper script, as this project's machines have
    (on_path / "nvcc").write_text(f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    (on_path / "nvcc").chmod(0o755)
    found = cuda_home()
    assert found != str(tmp_path / "local")
    assert found is None or os.path.exists(os.path.join(found, "include", "cuda_runtime.h"))
