"""Loads the compiled ops (megatron_sp._C) once and decides, per call, whether to use them.

Import never fails: when the extension is missing or does not load, the public ops run their
PyTorch references and a one-line notice is logged the first time a fused op is asked for.
"""
from __future__ import annotations

import logging

import torch

_log = logging.getLogger("megatron_sp.ops")


def _load() -> str:
    """Imports megatron_sp._C (registering torch.ops.megatron_sp.*); returns '' or the failure."""
    try:
        import megatron_sp._C  # noqa: F401
    except (ImportError, OSError) as err:
        return f"{type(err).__name__}: {err}"
    return ""


_LOAD_ERROR = _load()
_noticed = False


def extension_available() -> bool:
    """True when megatron_sp._C loaded, i.e. the fused C++ (and maybe CUDA) ops exist."""
    return not _LOAD_ERROR


def _notice_once() -> None:
    global _noticed
    if not _noticed:
        _noticed = True
        _log.warning("megatron_sp._C is not available (%s); using the PyTorch reference ops. "
                     "Build it with `pip install --no-build-isolation -e .`.", _LOAD_ERROR)


def has_device_kernel(op_name: str, device_type: str) -> bool:
    """Whether megatron_sp::op_name has a kernel for this device ('cpu', 'cuda', ...)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_sp::{op_name}", key)


def use_fused(fused: bool, op_name: str, x: torch.Tensor) -> bool:
    """The dispatch rule of every public op: fused when asked for, built, and built for x's device."""
    if not fused:
        return False
    if not extension_available():
        _notice_once()
        return False
    return has_device_kernel(op_name, x.device.type)
