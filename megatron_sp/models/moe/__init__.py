"""Mixture of experts: the router, the experts and the MoE layer that fills a block's `mlp` slot
(megatron-core's transformer/moe/ split). The token exchange between ranks is megatron_sp/expert_parallel/."""
