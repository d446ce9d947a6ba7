"""Model fields that may differ from layer to layer, as Megatron-LM spells them: the context-parallel
communication type (`--cp-comm-type p2p a2a ...`, one value or one per layer) and the sliding window
(`--window-size`, with `--window-attn-skip-freq` choosing the windowed layers); their command-line
parsers and their per-layer reading. Layers are numbered from 1, as Megatron's layer_number.

    cp_comm_type           "p2p" | "a2a" | "allgather" | "a2a+p2p", or a tuple of those, one per layer
    window_size            (left, right) or None: key j is visible to query i iff i - left <= j <= i + right;
                           -1 is an infinite side (Megatron's and flash-attention's meaning). A causal
                           decoder has right 0.
    window_attn_skip_freq  None: every layer windowed; N: every N-th layer full (layer % N == 0), the
                           others windowed; a tuple of 0/1 per layer, 1 = windowed

This module imports nothing of megatron_sp: config.py declares the fields with these parsers.
"""

from __future__ import annotations

import argparse
import ast
from typing import Optional

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def window_size_type(text: str) -> tuple:
    """`--window-size`: "4096,0" or "(4096, 0)" -> (4096, 0) (Megatron's tuple_type)."""
    try:
        return tuple(int(part) for part in str(text).strip("()[] ").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--window-size takes two integers 'left,right' (e.g. 4096,0), got {text!r}."
        ) from None


def _pattern(node):
    """A list of ints built from list literals, + and * by an int (Megatron's "[1,1,1,0]*3")."""
    if isinstance(node, ast.List):
        return [_int(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pattern(node.left) + _pattern(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = node.left, node.right
        return _pattern(left) * _int(right) if isinstance(right, ast.Constant) else _int(left) * _pattern(right)
    raise ValueError("not a list pattern")


def _int(node) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    raise ValueError("not an integer")


def layer_freq_type(text: str, flag: str = "--window-attn-skip-freq"):
    """`--window-attn-skip-freq`, `--moe-layer-freq`: "4" -> 4, "([1]*3+[0])*2" -> (1, 1, 1, 0, 1, 1,
    1, 0) (Megatron's moe_freq_type, read without eval)."""
    text = str(text).strip()
    try:
        if "[" not in text:
            return int(text)
        values = _pattern(ast.parse(text, mode="eval").body)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(
            f"{flag} takes an integer N or a list pattern such as '[1,1,1,0]*3', got {text!r}."
        ) from None
    return tuple(values)


def format_window_size(value) -> list:
    return [",".join(str(v) for v in value)]


def format_layer_freq(value) -> list:
    return [str(value) if isinstance(value, int) else str(list(value))]


def format_words(value) -> list:
    """A value of a flag taking several words (nargs '+'): one token per word."""
    return [str(v) for v in value] if isinstance(value, (tuple, list)) else [str(value)]


def normalised_list(name: str, value):
    """A list given on the command line or in a saved config -> a tuple (the config is frozen and
    hashable); `--cp-comm-type a2a` (a one-word list) -> "a2a"."""
    if isinstance(value, list):
        value = tuple(value)
    if name == "cp_comm_type" and isinstance(value, tuple) and len(value) == 1:
        value = value[0]
    return value


def layer_cp_comm_type(cfg, layer: int) -> str:
    """The CP communication type of layer `layer` (1-based)."""
    types = cfg.cp_comm_type
    return types if isinstance(types, str) else types[layer - 1]


def cp_comm_types(cfg) -> tuple:
    """The CP communication type of every layer, in order."""
    return tuple(layer_cp_comm_type(cfg, layer) for layer in range(1, cfg.num_layers + 1))


def zigzag_split(cfg) -> bool:
    """Whether a CP rank holds zigzag chunks (r and 2c-1-r): every type but a2a needs them, and all
    layers share one split, so a2a layers read zigzag chunks too when any layer is another type."""
    return any(t != "a2a" for t in cp_comm_types(cfg))


def is_window_layer(cfg, layer: int) -> bool:
    """Megatron's is_layer_window_attention."""
    if cfg.window_size is None:
        return False
    freq = cfg.window_attn_skip_freq
    if freq is None:
        return True
    if isinstance(freq, int):
        return layer % freq != 0
    return bool(freq[layer - 1])


def moe_layer_freq_type(text: str):
    """`--moe-layer-freq`: as layer_freq_type."""
    return layer_freq_type(text, "--moe-layer-freq")


def is_moe_layer(cfg, layer: int) -> bool:
    """Whether layer `layer` (1-based) has a mixture-of-experts MLP: with N, layers 1, N + 1, 2N + 1 ...
    (Megatron's `(layer - 1) % N == 0`); with a pattern, its 1s."""
    if cfg.num_experts is None:
        return False
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        return (layer - 1) % freq == 0
    return bool(freq[layer - 1])


def layer_window(cfg, layer: int) -> Optional[int]:
    """How many earlier tokens a query of layer `layer` sees besides itself, or None for all."""
    if not is_window_layer(cfg, layer):
        return None
    left = cfg.window_size[0]
    return None if left < 0 else left
