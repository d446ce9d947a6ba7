"""The ops package without the compiled extension: import works, references run, one notice."""

import subprocess
import sys

import torch
from cuda_cases import skip_or_fail

from megatron_sp import ops

NO_EXTENSION = r"""
import sys, logging, torch
sys.modules["megatron_sp._C"] = None          # makes `import megatron_sp._C` raise ImportError
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
from megatron_sp import ops
from megatron_sp.tensor_parallel.random import default_index
assert not ops.extension_available()
x, w, b = torch.randn(4, 2, 8), torch.ones(8), torch.zeros(8)
ops.layer_norm(x, w, b, 1e-5)
ops.bias_dropout_add(x, b, x, 0.1, 1, 0, 2, default_index(4, 2))
ops.zigzag_reorder(x, 2)
print("OK")
"""


def test_import_and_ops_work_without_extension():
    proc = subprocess.run([sys.executable, "-c", NO_EXTENSION], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"
    notices = [line for line in proc.stderr.splitlines() if "megatron_sp._C is not available" in line]
    assert len(notices) == 1, proc.stderr


def test_extension_builds_cpu_kernels():
    # scripts/env.sh builds the extension: its CPU kernels must be registered (with
    # MEGATRON_SP_REQUIRE_EXTENSION=1 a missing build fails here rather than skips).
    if not ops.extension_available():
        skip_or_fail("megatron_sp._C is not built")
    from megatron_sp.ops._extension import BUILT_DEVICES

    assert "cpu" in BUILT_DEVICES
    for name in ("bias_dropout_add_fwd", "layer_norm_bwd", "rms_norm_fwd", "zigzag_reorder", "flash_attention_bwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_sp::{name}", "CPU"), name
