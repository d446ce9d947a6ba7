"""Fused ops at the sequence-parallel boundary.

Each op has a pure-PyTorch reference here and, when megatron_sp._C is built, a fused C++/CUDA
implementation registered as a torch custom op (namespace `megatron_sp`). The public functions
dispatch to the fused op when `fused=True` and the extension is built for the tensor's device,
otherwise to the reference, so importing never fails without the extension.
"""

from megatron_sp.ops._extension import extension_available
from megatron_sp.ops.dropout_add import dropout_add, dropout_add_reference
from megatron_sp.ops.flash_attention import (
    AttentionDropout,
    flash_attention,
    flash_attention_bwd,
    flash_attention_bwd_reference,
    flash_attention_fwd,
    flash_attention_fwd_reference,
    merge_partials,
)
from megatron_sp.ops.layer_norm import layer_norm, layer_norm_reference
from megatron_sp.ops.layout import (
    gather_to_last_dim,
    gather_to_last_dim_reference,
    last_dim_to_gather,
    last_dim_to_gather_reference,
    ulysses_heads_to_send,
    ulysses_pack,
    ulysses_pack_reference,
    ulysses_recv_to_heads,
    ulysses_unpack,
    ulysses_unpack_reference,
    zigzag_reorder,
    zigzag_reorder_reference,
)
from megatron_sp.ops.rms_norm import rms_norm, rms_norm_reference

__all__ = [
    "extension_available",
    "dropout_add",
    "dropout_add_reference",
    "AttentionDropout",
    "flash_attention",
    "flash_attention_fwd",
    "flash_attention_bwd",
    "flash_attention_fwd_reference",
    "flash_attention_bwd_reference",
    "merge_partials",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "ulysses_pack",
    "ulysses_pack_reference",
    "ulysses_unpack",
    "ulysses_unpack_reference",
    "ulysses_recv_to_heads",
    "ulysses_heads_to_send",
    "gather_to_last_dim",
    "gather_to_last_dim_reference",
    "last_dim_to_gather",
    "last_dim_to_gather_reference",
    "zigzag_reorder",
    "zigzag_reorder_reference",
]
