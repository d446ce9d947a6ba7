"""PipelineGPT: this rank's pipeline stages of the TP+SP(+CP) model, run by a torch.distributed.pipelining
schedule. The same function, parameter names and full state dicts as GPTModel / ReferenceGPT.

PipelineGPT is a GPTModel built with this rank's stages (pipeline_parallel/layout.py; LanguageModel's
`stages`, megatron-core's pre_process / post_process), on the meta device, its shards materialised as
GPTModel's are: the parameter names are the global ones (`layers.{i}.…`, layer ids i + 1 keying
dropout), so every parameter starts bit-identical to the serial model's. It adds no build code: each
stage the schedule runs is a view (StageChunk) of the model's modules, whose forward is
LanguageModel.run_stage.

    stage 0        tokens [mb, s] -> embedding -> its layers -> x [s_sp, mb, h]   (sent to stage 1)
    stage k        x [s_sp, mb, h] -> its layers -> x                            (s_sp = s / cp / t under SP)
    last stage     x -> its layers -> final norm -> head -> the micro-batch's mean loss

The schedule passes positional arguments to the first stage only and keyword arguments to every
stage: each stage gets the micro-batch's tokens, labels, loss_mask, position_ids, attention_mask and
sample_ids as keywords (every rank of a pipeline reads the same batch), so each builds the micro-batch's
SequenceContext itself (dropout indices, positions, document masks) and only activations travel.

Tied embeddings (GPT-2): the last stage holds a copy of `embedding.word_embeddings.weight`, drawn
identically (the same name); `finalize_embedding_grads` sums the two copies' gradients over the
embedding group (first and last pipeline rank) before the step, so the copies stay identical. Under the
V shape (zbv) rank 0 holds both stages and the two share one parameter.

full_state_dict / full_grad_dict are collective over the TP and PP groups: every rank of a pipeline
gets the whole model's dict, gathered over TP and merged over the stages.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from megatron_sp import parallel_state
from megatron_sp.models.blocks import residual_dtype
from megatron_sp.models.gpt import GPTModel, check_parallel_sizes, gradient_of
from megatron_sp.models.init import torch_dtype
from megatron_sp.models.language_model import Stage
from megatron_sp.models.moe import losses as moe_losses
from megatron_sp.models.trainable import TrainableModel
from megatron_sp.pipeline_parallel.layout import PipelineLayout, stage_layers

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "sample_ids")  # step()'s fields


@runtime_checkable
class PipelinedModel(TrainableModel, Protocol):
    """A model run by a pipeline schedule (PipelineGPT): what the training loop and FSDP2 ask beyond
    TrainableModel's."""

    before_last_backward: Optional[Callable]  # hooks into the schedule's backward (see PipelineGPT)
    after_weight_backward: Optional[Callable]

    @property
    def stage_chunks(self) -> list:
        """This rank's stages' forward modules, in stage order."""
        ...

    def step(self, tokens, labels, *, num_microbatches: int, **inputs) -> torch.Tensor:
        """Forward and backward of the whole batch through the schedule: the micro-batch losses [m]."""
        ...


class StageChunk(nn.Module):
    """One pipeline stage's forward: LanguageModel.run_stage on a view of the model's modules (their
    parameters are the model's; they are children here so that FSDP2 and the schedule see them)."""

    def __init__(self, model: "PipelineGPT", stage: Stage):
        super().__init__()
        self.cfg, self.builder, self.partial_grads = model.cfg, model.builder, model.partial_grads
        self.stage, self._run_stage = stage, model.run_stage  # (bound methods: not children)
        self._loss_weight = model.loss_weight
        self.embedding = model.embedding if stage.first else None
        self.blocks = nn.ModuleList(model.layers[i] for i in stage.layers)
        if stage.last:
            self.final_ln, self.head = model.final_ln, model.head
            self.output = model.output_layer if model.output_layer is not None else model.embedding.word_embeddings

    def forward(self, x, *, tokens, labels=None, **batch):
        """x: the tokens [mb, s] on the first stage, else the hidden states [s_sp, mb, h]."""
        if torch.is_grad_enabled():
            self.partial_grads.expect()
        seq = self.builder.sequence_context(self.cfg, tokens, labels=labels, training=self.training, **_batch(batch))
        out = self._run_stage(self.stage, x, seq)
        if self.stage.last:  # (its MoE losses ride on the loss: LanguageModel.run_stage)
            return out
        target = batch.get("loss_mask") if batch.get("loss_mask") is not None else labels
        return moe_losses.attach_to_output(out, seq, self._loss_weight(target))


def _batch(batch):
    return {k: batch.get(k) for k in ("loss_mask", "position_ids", "attention_mask", "sample_ids")}


class PipelineGPT(GPTModel):
    """This rank's stages of cfg's model under `layout` (see the module docstring); a PipelinedModel.

    step(tokens, labels, num_microbatches=m, ...) runs forward and backward of the whole batch [B, s]
    (B = m · micro-batch) through the schedule and returns the m micro-batch losses [m] on every rank of
    the pipeline; gradients accumulate in the parameters (each micro-batch's loss weighted 1/m, or its
    token count with per_token=True, times `scale`)."""

    def __init__(self, cfg, layout: PipelineLayout, ps=None, spec=None, *, device=None):
        ps = ps if ps is not None else parallel_state.get()
        check_parallel_sizes(cfg, ps)  # (before the layout's checks, as GPTModel's own)
        if layout.pp_size != ps.pp_size:
            raise ValueError(f"the layout's pp_size ({layout.pp_size}) is not the PP group size ({ps.pp_size}).")
        layout.check(cfg.num_layers)
        stage_ids, last, ranges = (
            layout.rank_stages(ps.pp_rank),
            layout.num_stages - 1,
            stage_layers(cfg.num_layers, layout),
        )
        stages = [Stage(ranges[s], first=s == 0, last=s == last) for s in stage_ids]
        device = torch.device(device if device is not None else torch.get_default_device())
        super().__init__(cfg, ps, spec, device=device, stages=stages)
        self.layout, self.stage_ids, self.last_stage, self.device = layout, stage_ids, last, device
        self._chunks = [StageChunk(self, stage) for stage in self.stages]  # a plain list: views, not children
        self._schedules = {}
        self._embedding_pending = False
        self._scale, self._per_token, self._num_microbatches = 1.0, False, 1
        # The training loop's hooks into the schedule (gradient buffers, the overlapped DP sync):
        # before_last_backward(params) just before a stage's final backward of the step (its weight pass
        # under a zero-bubble schedule), with the parameters whose gradients it completes;
        # after_weight_backward(params) after each zero-bubble weight pass, which leaves `.grad` set.
        self.before_last_backward = None
        self.after_weight_backward = None
        if self.embedding is not None and self._tied_across_ranks():  # summed over the embedding group
            self.embedding.word_embeddings.weight.waits_for_step_sums = True  # first: no early DP reduction

    @property
    def stage_chunks(self) -> list:
        """This rank's stages' forward modules, in stage order (FSDP2 makes each a root: distributed/fsdp.py)."""
        return list(self._chunks)

    def _tied_across_ranks(self) -> bool:
        layout = self.layout
        tied = not self.cfg.untie_embeddings_and_output_weights and self.ps.pp_size > 1
        return tied and layout.stage_rank(0) != layout.stage_rank(self.last_stage)

    def train(self, mode: bool = True):
        super().train(mode)
        for chunk in getattr(self, "_chunks", []):
            chunk.train(mode)
        return self

    # ---- the schedule ------------------------------------------------------------------------
    def _schedule(self, micro_batch: int, seq_length: int, num_microbatches: int):
        key = (micro_batch, seq_length, num_microbatches)
        if key not in self._schedules:
            stages = [
                self._pipeline_stage(s, chunk, micro_batch, seq_length)
                for s, chunk in zip(self.stage_ids, self._chunks)
            ]
            self._schedules[key] = _make_schedule(self.layout.schedule, stages, num_microbatches, self._loss)
        return self._schedules[key]

    def _pipeline_stage(self, stage, chunk, micro_batch, seq_length):
        ps, cfg = self.ps, self.cfg
        s_sp = seq_length // ps.cp_size // (ps.tp_size if cfg.sequence_parallel else 1)
        hidden = torch.empty(
            (s_sp, micro_batch, cfg.hidden_size),
            dtype=residual_dtype(cfg, torch_dtype(cfg.params_dtype)),
            device="meta",
            requires_grad=True,  # the stage sends back its input's gradient
        )
        tokens = torch.empty((micro_batch, seq_length), dtype=torch.long, device="meta")
        loss = torch.empty((), dtype=torch.float32, device="meta")
        from torch.distributed import pipelining  # (here: importing it costs every run ~1 s)

        made = pipelining.PipelineStage(
            chunk,
            stage,
            self.layout.num_stages,
            self.device,
            input_args=tokens if stage == 0 else hidden,
            output_args=loss if stage == self.last_stage else hidden,
            group=ps.pp_group,
        )
        self._hook_backward(made, self._completed_params(stage, chunk))
        return made

    def _completed_params(self, stage, chunk) -> list:
        """The parameters whose step gradient is complete after `stage`'s final backward: the chunk's,
        less those a lower stage of this rank also uses (the V's tied embedding: stage 0 runs last)."""
        lower = {id(p) for s, c in zip(self.stage_ids, self._chunks) if s < stage for p in c.parameters()}
        return [p for p in chunk.parameters() if id(p) not in lower]

    def _hook_backward(self, stage, params):
        """Wraps the stage's backward so the training loop's hooks run (see __init__): before the final
        full backward, or around the weight passes of a zero-bubble schedule."""
        full, weight = stage.backward_one_chunk, stage.backward_weight_one_chunk

        def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            if last_backward and self.before_last_backward is not None:
                self.before_last_backward(params)
            return full(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

        def backward_weight_one_chunk(bwd_chunk_id, last_backward=False):
            if last_backward and self.before_last_backward is not None:
                self.before_last_backward(params)
            weight(bwd_chunk_id, last_backward=last_backward)
            if self.after_weight_backward is not None:
                self.after_weight_backward(params)

        stage.backward_one_chunk, stage.backward_weight_one_chunk = backward_one_chunk, backward_weight_one_chunk
        if self.layout.v_shape:
            _forward_only_v(stage)

    def _loss(self, output, target):
        """The schedule's loss_fn: the last stage's micro-batch loss, weighted (the backward's seed)."""
        self._micro_losses.append(output.detach())
        return output * self.loss_weight(target)

    def loss_weight(self, target) -> float:
        """The gradient a micro-batch's loss receives (target: its loss mask, else its labels): the loss
        scale times 1 / m, or times its token count with per_token. The MoE auxiliary losses of the
        stages before the last take the same (StageChunk)."""
        if not self._per_token:
            return self._scale / self._num_microbatches
        count = target.sum() if target.dtype.is_floating_point else target.numel()
        return self._scale * float(count)

    def step(
        self,
        tokens,
        labels,
        *,
        num_microbatches: int,
        loss_mask=None,
        position_ids=None,
        attention_mask=None,
        sample_ids=None,
        scale: float = 1.0,
        per_token: bool = False,
        forward_only: bool = False,
    ) -> torch.Tensor:
        """See the class docstring; forward_only: the evaluation pass (no backward, no gradients)."""
        batch, s = tokens.shape
        if batch % num_microbatches != 0:
            raise ValueError(f"the batch of {batch} samples does not split into {num_microbatches} micro-batches.")
        self.layout.check_microbatches(num_microbatches)
        if sample_ids is None:  # global sample indices across the micro-batches, as the whole batch's
            sample_ids = torch.arange(batch, device=tokens.device)
        inputs = dict(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            position_ids=position_ids,
            attention_mask=attention_mask,
            sample_ids=sample_ids,
        )
        inputs = {k: v for k, v in inputs.items() if v is not None}
        schedule = self._schedule(batch // num_microbatches, s, num_microbatches)
        self._micro_losses, self._scale, self._per_token = [], scale, per_token
        self._num_microbatches = num_microbatches
        first_args = (tokens,) if 0 in self.stage_ids else ()
        target = loss_mask if loss_mask is not None else labels
        if forward_only:
            with torch.no_grad():
                schedule.eval(*first_args, target=target, return_outputs=False, **inputs)
        else:
            schedule.step(*first_args, target=target, return_outputs=False, **inputs)
            self._embedding_pending = True
        return self._broadcast_losses(num_microbatches)

    def _broadcast_losses(self, num_microbatches):
        """The last stage's micro-batch losses [m], on every rank of the pipeline."""
        losses = torch.zeros(num_microbatches, dtype=torch.float32, device=self.device)
        if self._micro_losses:
            losses.copy_(torch.stack([loss.float() for loss in self._micro_losses]))
        if self.ps.pp_size > 1:
            src = self.ps.pp_ranks[self.layout.stage_rank(self.last_stage)]
            dist.broadcast(losses, src=src, group=self.ps.pp_group)
        return losses

    # ---- gradients ---------------------------------------------------------------------------
    @torch.no_grad()
    def finalize_embedding_grads(self, grad=None) -> None:
        """Sums the tied word embedding's gradient over its first- and last-stage copies (collective
        over the embedding group; nothing when untied, at pp 1, or when one rank holds both stages)."""
        pending, self._embedding_pending = self._embedding_pending, False
        layout = self.layout
        if not pending or self.cfg.untie_embeddings_and_output_weights or self.ps.pp_size == 1:
            return
        if layout.stage_rank(0) == layout.stage_rank(self.last_stage) or self.embedding is None:
            return
        g = (grad or gradient_of)(self.embedding.word_embeddings.weight)
        if g is None:
            g = torch.zeros_like(self.embedding.word_embeddings.weight)
            self.embedding.word_embeddings.weight.grad = g
        dist.all_reduce(g, group=self.ps.embedding_group)

    # ---- full state ----------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self):
        """Collective over the TP and PP groups: the whole model's unsharded parameters, ReferenceGPT keys."""
        return self._merge_stages(super().full_state_dict())

    @torch.no_grad()
    def full_grad_dict(self):
        """Collective: the whole model's unsharded gradients (partial sums and tied copies summed first)."""
        return self._merge_stages(super().full_grad_dict())

    def _merge_stages(self, local: dict) -> dict:
        if self.ps.pp_size == 1:
            return local
        parts = [None] * self.ps.pp_size
        dist.all_gather_object(parts, {k: v.cpu() for k, v in local.items()}, group=self.ps.pp_group)
        merged = {}
        for part in parts:  # a tied copy appears twice, identical: the first one is kept
            for name, tensor in part.items():
                merged.setdefault(name, tensor.to(self.device))
        return merged


def schedule_problem(name: str, version: Optional[str] = None) -> Optional[str]:
    """Why this torch cannot run schedule `name`, or None. ZBVZeroBubble hangs (ranks spinning, no
    step ends) under torch 2.11's pipelining, seen on gloo with our stages; it runs under 2.13, the
    pinned torch (2.12 not tried)."""
    version = version or torch.__version__
    if name == "zbv" and tuple(int(p) for p in version.split("+")[0].split(".")[:2]) < (2, 13):
        return (
            f"--pipeline-schedule zbv needs torch 2.13 or newer: torch {version}'s ZBVZeroBubble schedule hangs "
            "(seen under 2.11); use interleaved-zb, or 1f1b with virtual stages."
        )
    return None


def _make_schedule(name: str, stages: list, num_microbatches: int, loss_fn):
    """The torch.distributed.pipelining schedule of --pipeline-schedule for this rank's stages."""
    from torch.distributed import pipelining

    problem = schedule_problem(name)
    if problem:
        raise RuntimeError(problem)

    kwargs = dict(n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    if name == "gpipe":
        return pipelining.ScheduleGPipe(stages[0], **kwargs)
    if name == "zbv":
        return pipelining.ScheduleZBVZeroBubble(stages, **kwargs)
    if name == "interleaved-zb":
        return pipelining.ScheduleInterleavedZeroBubble(stages, **kwargs)
    if len(stages) == 1:
        return pipelining.Schedule1F1B(stages[0], **kwargs)
    return pipelining.ScheduleInterleaved1F1B(stages, **kwargs)


def _forward_only_v(stage):
    """torch 2.13's zbv schedule hands the input gradients between the V's two adjacent stages of a rank
    even in `eval()` (forward only), where the stages have none and raise: there, nothing is handed."""
    get_output, set_input = stage.get_local_bwd_output, stage.set_local_bwd_input

    def get_local_bwd_output(mb_index):
        return get_output(mb_index) if stage.has_backward else ()

    def set_local_bwd_input(next_stage_bwd_outputs, mb_index):
        if stage.has_backward:
            set_input(next_stage_bwd_outputs, mb_index)

    stage.get_local_bwd_output, stage.set_local_bwd_input = get_local_bwd_output, set_local_bwd_input
