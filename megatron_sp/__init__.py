"""megatron_sp: tensor + sequence parallel GPT pretraining on torch.distributed.

The package layout follows DESIGN.md: parallel_state (process groups), config (GPTConfig),
tensor_parallel (mappings, layers, cross entropy, dropout), models (ReferenceGPT, GPTModel),
ops (fused kernels with references), training, data.
"""

__version__ = "0.1.0"
