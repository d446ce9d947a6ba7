"""Fused ops at the sequence-parallel boundary.

Each op has a pure-PyTorch reference here and, when megatron_sp._C is built, a fused C++/CUDA
implementation registered as a torch custom op (namespace `megatron_sp`). The public functions
dispatch to the fused op when `fused=True` and the extension is available, otherwise to the
reference, so importing never fails without the extension.
"""
from megatron_sp.ops.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from megatron_sp.ops.layer_norm import layer_norm, layer_norm_reference

__all__ = ["bias_dropout_add", "bias_dropout_add_reference", "layer_norm", "layer_norm_reference"]
