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
        _log.warning(
            "megatron_sp._C is not available (%s); using the PyTorch reference ops. "
            "Build it with `pip install --no-build-isolation -e .`.",
            _LOAD_ERROR,
        )


def _built_devices() -> frozenset:
    """Device types ('cpu', 'cuda') the extension has kernels for; all ops are built together."""
    if _LOAD_ERROR:
        return frozenset()
    probe = "megatron_sp::layer_norm_fwd"
    return frozenset(
        dev
        for dev, key in (("cpu", "CPU"), ("cuda", "CUDA"))
        if torch._C._dispatch_has_kernel_for_dispatch_key(probe, key)
    )


# Computed once at import: a plain constant, so torch.compile traces use_fused without a break.
BUILT_DEVICES = _built_devices()


def use_fused(fused: bool, x: torch.Tensor) -> bool:
    """The dispatch rule of every public op: fused when asked for, built, and built for x's device."""
    if not fused:
        return False
    if not BUILT_DEVICES:
        _notice_once()
        return False
    return x.device.type in BUILT_DEVICES


def register_op(name: str, fake_fwd, fake_bwd, backward, setup_context) -> bool:
    """Registers megatron_sp::{name}_fwd/_bwd's fake (meta) kernels and _fwd's autograd formula; returns
    whether the op is built. False without the extension, or with one built before the op existed
    (rebuild it): the op's reference runs then."""
    if not (extension_available() and hasattr(torch.ops.megatron_sp, f"{name}_fwd")):
        return False
    torch.library.register_fake(f"megatron_sp::{name}_fwd")(fake_fwd)
    torch.library.register_fake(f"megatron_sp::{name}_bwd")(fake_bwd)
    torch.library.register_autograd(f"megatron_sp::{name}_fwd", backward, setup_context=setup_context)
    return True
