"""One decoder-only language model assembled from a ModelSpec and a builder:

    tokens [b, s] -> embedding -> layers (spec.block) -> final norm -> head (tied or untied) -> loss

With SerialBuilder it is the serial oracle (ReferenceGPT), with ParallelBuilder the TP+SP model
(GPTModel); both have the same state-dict keys, the full shapes being the serial ones:

    embedding.word_embeddings.weight       [V, h]         (also the output layer when tied)
    embedding.position_embeddings.weight   [P, h]         learned positions only
    layers.{i}.ln1.{weight,bias}           [h]            (RMSNorm: weight only)
    layers.{i}.attn.qkv.{weight,bias}      [(n + 2 n_kv) d, h]   rows: q heads, k heads, v heads
    layers.{i}.attn.proj.{weight,bias}     [h, n d], [h]
    layers.{i}.ln2.{weight,bias}           [h]
    layers.{i}.mlp.fc1.{weight,bias}       [f, h] ([2f, h]: SwiGLU gate rows, then up rows)
    layers.{i}.mlp.fc2.{weight,bias}       [h, f], [h]
    final_ln.{weight,bias}                 [h]
    output_layer.weight                    [V, h]         untied only
(biases only with add_bias_linear / add_qkv_bias; n query heads, n_kv key/value heads, d head dim).

A model may hold only some of this: `stages` (megatron-core's pre_process / post_process idea) names
the layer ranges it builds and whether it holds the first stage (the embedding) and the last (final
norm, head, output layer). The whole model is one stage; a pipeline rank builds its stages
(pipeline_parallel/model.py), each parameter under its global name, so it is drawn as the serial one.
A last stage without the first holds a copy of the tied word embedding under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_sp.models.init import check_init_tags, initialise_, torch_dtype
from megatron_sp.models.moe import losses as moe_losses
from megatron_sp.models.registry import get_spec


@dataclass(frozen=True)
class Stage:
    """A share of the model: transformer layers `layers` (global indices), with the embedding when
    `first` (megatron-core's pre_process) and the final norm and head when `last` (post_process)."""

    layers: range
    first: bool = True
    last: bool = True


class LayerStack(nn.Module):
    """The transformer layers a model holds under their global indices (`layers.{i}.…` names layer i
    wherever it is built); indexed by that index, iterated and counted as a list, in build order."""

    def __init__(self, blocks: dict):
        super().__init__()
        for i, block in blocks.items():
            self.add_module(str(i), block)

    def __getitem__(self, i: int) -> nn.Module:
        return self._modules[str(i)]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class LanguageModel(nn.Module):
    """forward(tokens [b, s], labels [b, s]) -> mean loss; labels=None -> logits [b, s, V].

    Keyword-only: loss_mask [b, s]; position_ids [b, s] (document resets); attention_mask
    [b, 1, s, s] bool, True = masked (Megatron); sample_ids [b] global sample indices keying dropout.

    stages: the shares of the model built here (default: one, the whole model); forward runs the whole
    model, run_stage one stage.

    Built on the meta device: no parameter memory is allocated until `materialise` gives each
    parameter its own shard, drawn in place (models/init.py), in cfg.params_dtype.
    """

    def __init__(self, cfg, builder, spec=None, *, stages=None):
        with torch.device("meta"):
            self._build(cfg, builder, spec, tuple(stages) if stages is not None else (Stage(range(cfg.num_layers)),))

    def _build(self, cfg, builder, spec, stages):
        super().__init__()
        self.spec = spec if spec is not None else get_spec(cfg.model)
        self.cfg, self.builder, self.stages = cfg, builder, stages
        block_spec, n = self.spec.block, cfg.num_layers
        first, last = any(s.first for s in stages), any(s.last for s in stages)
        self.embedding = self.final_ln = self.output_layer = self.head = None
        # Layer ids key the dropout masks: 0 the embedding, i + 1 transformer layer i.
        if first:
            self.embedding = self.spec.embedding(cfg, layer=0, builder=builder, block_spec=block_spec)
        elif last and not cfg.untie_embeddings_and_output_weights:
            self.embedding = _tied_copy(cfg, builder)
        blocks = {i: block_spec.build(cfg, layer=i + 1, builder=builder) for s in stages for i in s.layers}
        self.layers = LayerStack(blocks)
        if last:
            self.final_ln = self.spec.final_norm(cfg, layer=n + 1, builder=builder, block_spec=block_spec)
            if cfg.untie_embeddings_and_output_weights:
                self.output_layer = builder.output_layer(cfg)
            self.head = builder.lm_head(cfg)
        check_init_tags(self)

    @property
    def is_whole(self) -> bool:
        """Whether this model holds all of it (one stage: every layer, the first and the last)."""
        return self.stages == (Stage(range(self.cfg.num_layers)),)

    @torch.no_grad()
    def materialise(self, device, *, tp_rank: int = 0, tp_size: int = 1, draw: bool = True, coords=None):
        """Replaces every meta parameter by a tensor of cfg.params_dtype on `device` holding this rank's
        slice of the serial initial value (draw=False: uninitialised, to be loaded); parameter
        attributes (shard_spec, init tag, ...) are kept. Buffers move to `device` (their dtype kept).
        coords(role) -> (rank, size) of the group a ShardSpec names (default: tp_rank, tp_size)."""
        coords = coords if coords is not None else (lambda role: (tp_rank, tp_size))
        dtype, on_meta = torch_dtype(self.cfg.params_dtype), torch.device(device).type == "meta"
        made = {}  # id(meta parameter) -> its real one: a parameter shared by two modules stays shared
        for prefix, module in self.named_modules(remove_duplicate=False):
            for key, meta in list(module._parameters.items()):
                if meta is None or not (meta.is_meta or id(meta) in made):
                    continue
                if id(meta) not in made:
                    real = nn.Parameter(torch.empty(meta.shape, dtype=dtype, device=device), meta.requires_grad)
                    real.__dict__.update(meta.__dict__)  # shard_spec, sequence_parallel, init_tag
                    name = f"{prefix}.{key}" if prefix else key
                    if draw and not on_meta:
                        rank, size = coords(real.shard_spec.group)
                        initialise_(real.data, name, real.init_tag, real.shard_spec, self.cfg, rank, size)
                    made[id(meta)] = (meta, real)  # (meta kept alive: its id stays unique)
                module._parameters[key] = made[id(meta)][1]
            for key, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta and not on_meta:
                    raise ValueError(f"buffer {prefix}.{key} was created on the meta device: give it device='cpu'.")
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
        return self

    def forward(self, tokens, labels=None, *, loss_mask=None, position_ids=None, attention_mask=None, sample_ids=None):
        if not self.is_whole:
            raise ValueError(
                f"this model holds pipeline stages {list(self.stages)}, not the whole model: run it through "
                "its stages (PipelineGPT.step)."
            )
        seq = self.builder.sequence_context(
            self.cfg,
            tokens,
            labels=labels,
            loss_mask=loss_mask,
            position_ids=position_ids,
            attention_mask=attention_mask,
            sample_ids=sample_ids,
            training=self.training,
        )
        return self.run_stage(self.stages[0], tokens, seq)

    def run_stage(self, stage: Stage, x, seq):
        """One stage's forward on the batch of `seq`: x is the tokens [b, s] on the first stage, else the
        previous stage's hidden states [s_sp, b, h]; the last stage returns the head's output (loss or
        logits), any other its hidden states."""
        if stage.first:
            x = self.embedding(seq.tokens, seq)  # [s_sp, b, h]
        x = run_layers(self.cfg, [self.layers[i] for i in stage.layers], x, seq)
        if not stage.last:
            return x
        weight = (self.output_layer if self.output_layer is not None else self.embedding.word_embeddings).weight
        out = self.head(self.final_ln(x), weight, seq)
        return moe_losses.attach(out, seq) if seq.labels is not None else out


def _tied_copy(cfg, builder) -> nn.Module:
    """A last stage's copy of the tied word embedding, under the first stage's name (so drawn the same);
    pipeline_copy: norms and counts take the first stage's."""
    holder = nn.Module()
    holder.word_embeddings = builder.word_embedding(cfg)
    holder.word_embeddings.weight.pipeline_copy = True
    return holder


def run_layers(cfg, layers, x, seq):
    """The transformer layers `layers` (a list of blocks) on x; with full recomputation some run under
    activation checkpointing, which keeps only their input and runs them again in the backward (dropout
    masks are keyed by position, so the rerun draws the same bits; collectives rerun in the same order on
    every rank). A pipeline stage passes its own layers: "block" recomputes the first n of each stage."""
    if cfg.recompute_granularity != "full" or not torch.is_grad_enabled():
        for block in layers:
            x = block(x, seq)
        return x
    n = cfg.recompute_num_layers
    if cfg.recompute_method == "block":  # the first n layers, one at a time
        for i, block in enumerate(layers):
            x = checkpoint(block, x, seq, use_reentrant=False) if i < n else block(x, seq)
        return x
    for start in range(0, len(layers), n):  # uniform: chunks of n layers
        x = checkpoint(_run_chunk, layers[start : start + n], x, seq, use_reentrant=False)
    return x


def _run_chunk(blocks, x, seq):
    for block in blocks:
        x = block(x, seq)
    return x
