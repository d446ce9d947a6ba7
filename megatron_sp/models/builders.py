"""Builders: the only place where the serial oracle and the tensor (+sequence) parallel model differ.

A model spec's slots (models/blocks.py, models/attention.py) create their layers through the
`builder` they are given:

    method                       SerialBuilder (oracle)        ParallelBuilder (TP, SP, CP)
    column(in, out, ...)         Linear [out, in]              ColumnParallelLinear [out/t, in], gathers x under SP
                                                               (in ring steps under the GEMM: tp_comm_overlap)
    row(in, out, ...)            Linear [out, in]              RowParallelLinear [out, in/t], reduce(-scatter)s
    word_embedding(cfg)          [V, h] lookup                 VocabParallelEmbedding [V_pad/t, h]
    output_layer(cfg)            [V, h]                        [V_pad/t, h]
    lm_head(cfg)                 logits, F.cross_entropy       vocab-parallel logits and cross entropy (CP mean)
    wrap_core_attention(core)    the spec's core               the layer's --cp-comm-type: the core inside
                                                               Ulysses' all-to-alls (a2a), or ring attention
                                                               (p2p), all-gathered keys (allgather), a2a
                                                               within and the ring across groups (a2a+p2p)
    sequence_context(cfg, ...)   the whole sequence            this rank's tokens (CP) and SP-region rows
    expert_linear(in, out, ...)  Linear [out, in]              this rank's expert-TP shard (no collective:
                                                               the dispatcher moves the tokens)
    local_experts(cfg)           every expert                  the experts of this rank's EP rank
    token_dispatcher(cfg)        permute, experts, unpermute   the same around the EP exchange
                                                               (--moe-token-dispatcher-type)
    moe_groups()                 no groups                     the ranks routing statistics sum over
"""

from __future__ import annotations

from megatron_sp.context_parallel.allgather import AllGatherAttention
from megatron_sp.context_parallel.hierarchical import HierarchicalAttention
from megatron_sp.context_parallel.ring import RingAttention
from megatron_sp.context_parallel.ulysses import UlyssesAttention
from megatron_sp.expert_parallel.allgather import AllGatherDispatcher
from megatron_sp.expert_parallel.alltoall import AllToAllDispatcher
from megatron_sp.expert_parallel.permute import LocalDispatcher
from megatron_sp.layer_options import layer_cp_comm_type
from megatron_sp.models.attention import CausalAttention
from megatron_sp.models.lm_head import OutputLayer, ParallelLMHead, SerialLMHead
from megatron_sp.models.moe.losses import MoEGroups
from megatron_sp.models.sequence_context import sequence_context
from megatron_sp.models.serial_layers import Linear, WordEmbedding
from megatron_sp.parallel_state import EXPERT_REPLICAS, EXPERT_TP
from megatron_sp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron_sp.tensor_parallel.sharding import ShardSpec, local_dim_size


def expert_linear(in_features, out_features, spec, init, bias, etp_size):
    """An expert's Linear: this rank's share of the split dim, every parameter an expert's (its
    gradient reduced over the expert-data-parallel ranks)."""
    full = out_features if spec.dim == 0 else in_features
    local = local_dim_size(spec, full, etp_size)
    shape = (in_features, local) if spec.dim == 0 else (local, out_features)
    layer = Linear(*shape, init=init, bias=bias, shard_spec=spec)
    for p in layer.parameters():
        p.replica_role = EXPERT_REPLICAS
    return layer


class SerialBuilder:
    """Plain torch.nn layers on whole tensors: the oracle that defines the function."""

    tp_size, tp_rank, sequence_parallel = 1, 0, False

    def __init__(self, cfg=None):
        self.expert_bias = bool(cfg is not None and cfg.add_bias_linear)

    def column(self, in_features, out_features, *, init, bias, segments=(), units=()):
        return Linear(in_features, out_features, init=init, bias=bias, shard_spec=ShardSpec(0, segments, units))

    def row(self, in_features, out_features, *, init, bias):
        return Linear(in_features, out_features, init=init, bias=bias, shard_spec=ShardSpec(1))

    def word_embedding(self, cfg):
        return WordEmbedding(cfg.vocab_size, cfg.hidden_size, init="embedding")

    def output_layer(self, cfg):
        return OutputLayer(cfg.vocab_size, cfg.hidden_size, cfg.vocab_size)

    def lm_head(self, cfg):
        return SerialLMHead()

    def wrap_core_attention(self, core, cfg, *, layer):
        return core

    def sequence_context(self, cfg, tokens, **batch):
        """batch: labels, loss_mask, position_ids, attention_mask, sample_ids, training."""
        return sequence_context(cfg, tokens, **batch, sp_rows=slice(0, tokens.shape[1]))

    def expert_linear(self, in_features, out_features, *, split, init, segments=()):
        spec = ShardSpec(split, segments, group=EXPERT_TP)
        return expert_linear(in_features, out_features, spec, init, self.expert_bias, 1)

    def local_experts(self, cfg):
        return range(cfg.num_experts)

    def token_dispatcher(self, cfg):
        return LocalDispatcher()

    def moe_groups(self):
        return MoEGroups()


class ParallelBuilder:
    """Megatron's layers on this rank's shards; `ps` gives the TP and CP groups and coordinates."""

    def __init__(self, cfg, ps):
        self.ps, self.group = ps, ps.tp_group
        self.expert_bias = bool(cfg.add_bias_linear)
        self.tp_size, self.tp_rank, self.sequence_parallel = ps.tp_size, ps.tp_rank, cfg.sequence_parallel
        self.tp_comm_overlap = cfg.tp_comm_overlap

    def column(self, in_features, out_features, *, init, bias, segments=(), units=()):
        return ColumnParallelLinear(
            in_features,
            out_features,
            init=init,
            group=self.group,
            sequence_parallel=self.sequence_parallel,
            tp_comm_overlap=self.tp_comm_overlap,
            bias=bias,
            segments=segments,
            units=units,
        )

    def row(self, in_features, out_features, *, init, bias):
        return RowParallelLinear(
            in_features,
            out_features,
            init=init,
            group=self.group,
            sequence_parallel=self.sequence_parallel,
            tp_comm_overlap=self.tp_comm_overlap,
            bias=bias,
        )

    def word_embedding(self, cfg):
        return VocabParallelEmbedding(
            cfg.vocab_size,
            cfg.padded_vocab_size,
            cfg.hidden_size,
            group=self.group,
            sequence_parallel=self.sequence_parallel,
            init="embedding",
        )

    def output_layer(self, cfg):
        return OutputLayer(cfg.padded_vocab_size // self.tp_size, cfg.hidden_size, cfg.vocab_size)

    def lm_head(self, cfg):
        return ParallelLMHead(cfg, self.ps)

    def wrap_core_attention(self, core, cfg, *, layer):
        """The spec's core as context parallelism runs it (the core itself without CP)."""
        if self.ps.cp_size == 1:
            return core
        comm = layer_cp_comm_type(cfg, layer)
        if comm == "a2a":
            return UlyssesAttention(core, self.ps, cfg.use_fused_kernels)
        if type(core) is not CausalAttention:
            raise ValueError(
                f"cp_comm_type {comm} computes causal attention itself and cannot run the spec's "
                f"core_attention {type(core).__name__}; use cp_comm_type a2a or context_parallel_size 1."
            )
        if comm == "allgather":
            return AllGatherAttention(cfg, layer, self.ps)
        if comm == "a2a+p2p":
            return HierarchicalAttention(cfg, layer, self.ps)
        return RingAttention(cfg, layer, self.ps.cp_group)

    def sequence_context(self, cfg, tokens, **batch):
        """batch: labels, loss_mask, position_ids, attention_mask, sample_ids, training."""
        return sequence_context(
            cfg,
            tokens,
            **batch,
            sp_rows=self._sp_rows(tokens.shape[1]),
            cp_size=self.ps.cp_size,
            cp_rank=self.ps.cp_rank,
        )

    def expert_linear(self, in_features, out_features, *, split, init, segments=()):
        """A plain Linear holding this rank's expert-TP shard (fc1 rows, fc2 columns)."""
        spec = ShardSpec(split, segments, group=EXPERT_TP)
        return expert_linear(in_features, out_features, spec, init, self.expert_bias, self.ps.etp_size)

    def local_experts(self, cfg):
        local = cfg.num_experts // self.ps.ep_size
        return range(self.ps.ep_rank * local, (self.ps.ep_rank + 1) * local)

    def token_dispatcher(self, cfg):
        if self.ps.ep_size * self.ps.etp_size == 1:
            return LocalDispatcher()
        if cfg.moe_token_dispatcher_type == "alltoall":
            return AllToAllDispatcher(cfg.num_experts, self.ps)
        return AllGatherDispatcher(cfg.num_experts, self.ps, self.local_experts(cfg))

    def moe_groups(self):
        ps = self.ps
        seq, stage = ps.tp_size * ps.cp_size, ps.tp_size * ps.cp_size * ps.dp_size
        return MoEGroups(
            sp=self.sequence_parallel,
            seq_group=ps.tp_cp_group if seq > 1 else None,
            seq_size=seq,
            batch_group=ps.stage_group if stage > 1 else None,
            batch_size=stage,
            dp_size=ps.dp_size,
        )

    def _sp_rows(self, s: int) -> slice:
        """This rank's rows of its s / cp tokens in the SP region (all of them without SP)."""
        s_tp = s // self.ps.cp_size
        if not self.sequence_parallel:
            return slice(0, s_tp)
        if s_tp % self.tp_size != 0:
            raise ValueError(
                f"sequence length {s} is not divisible by TP size {self.tp_size} "
                f"× CP size {self.ps.cp_size} under sequence parallelism."
            )
        s_sp = s_tp // self.tp_size
        return slice(self.tp_rank * s_sp, (self.tp_rank + 1) * s_sp)
