"""The parity harness: the serial oracle and the parallel model at a layout, trained on the same
batches, and their differences. tests/test_parity.py, tests/test_hf_families.py and
tools/check_parity.py are its users.

    batches = make_batches(vocab, seq, batch, steps)        # the same batches for every layout
    serial = run_serial(fields, batches)                   # ReferenceGPT (this process)
    result = world.run(run_layout, fields, layout, batches, state=serial.init)   # per rank
    row = compare(serial, result[0], layout)                # loss, gradients, norm, weights after the steps

Each run takes the first step's loss and gradients, then AdamW steps (lr 1e-3, weight decay 0.01,
eps `adam_eps`: torch's 1e-8 unless the caller asks) after every batch; the gradients are the
parallel model's gathered ones (partial sums reduced, the data-parallel mean taken, the tied pipeline
copy summed). `fields` are GPTConfig fields without the layout's; dropout is whatever they say (the
contract holds with it on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_sp.testing.layouts import Layout

TOLERANCES = dict(loss=1e-5, grad=1e-5, grad_norm=1e-5, params=3e-5)  # relative, fp32
# params: AdamW's first steps are sign(g)·lr where |g| is near its eps (a GELU unit off for every token
# has such gradients in its fc1 bias), so 1e-7 gradient differences become ~1e-5 in those weights
# (measured: layers.0.mlp.fc1.bias 1.37e-5 at gpt2 TP=4 fused, 1.46e-5 at TP=2 x CP=2); a wrong step
# is off by >= 1e-3. (tests/test_moe_parallel.py passes adam_eps 1e-4, which bounds that to lr·δ/eps.)


@dataclass(frozen=True)
class Batch:
    """One global batch: [B, s] tokens and labels, [B] global sample ids (they key dropout), and
    optionally documents: [B, s] reset positions and the [B, 1, s, s] mask (True = masked)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None

    def part(self, index: int, parts: int) -> "Batch":
        """The index-th of `parts` equal slices of the samples (a data-parallel rank's)."""
        n = self.tokens.shape[0] // parts
        pick = slice(index * n, (index + 1) * n)
        return Batch(*(None if t is None else t[pick] for t in self.tensors()))

    def tensors(self) -> tuple:
        return (self.tokens, self.labels, self.sample_ids, self.position_ids, self.attention_mask)

    def inputs(self) -> dict:
        """The model's keyword inputs besides tokens and labels."""
        extra = dict(sample_ids=self.sample_ids, position_ids=self.position_ids, attention_mask=self.attention_mask)
        return {k: v for k, v in extra.items() if v is not None}


def document_inputs(batch: int, seq: int, starts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents starting at `starts` (default: 0, s/3, 5s/8) in every sample: ([B, s] positions
    restarting at each, [B, 1, s, s] mask of other documents' keys)."""
    starts = starts if starts is not None else [0, seq // 3, 5 * seq // 8]
    doc = torch.zeros(seq, dtype=torch.long)
    for start in starts[1:]:
        doc[start:] += 1
    positions = torch.arange(seq) - torch.tensor(starts)[doc]
    mask = (doc.view(-1, 1) != doc.view(1, -1)).view(1, 1, seq, seq).expand(batch, 1, seq, seq)
    return positions.expand(batch, seq), mask


def make_batches(vocab: int, seq: int, batch: int, steps: int, *, documents: bool = False, seed: int = 100) -> list:
    """`steps` random batches (step i drawn from seed + i; sample ids new every step)."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.randint(0, vocab, (batch, seq), generator=g)
        positions, mask = document_inputs(batch, seq) if documents else (None, None)
        out.append(Batch(tokens, labels, torch.arange(batch) + step * batch, positions, mask))
    return out


@dataclass
class Run:
    """What one model did: its initial weights, the losses of every step, the first step's gradients
    and their norm, the weights after the last step (all full, serial names); `extra`: a probe's."""

    init: dict
    losses: list
    grads0: dict
    norm0: float
    final: dict
    logits: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)
    zero_centered: bool = False  # --apply-layernorm-1p: norm weights stored as gamma - 1
    qkv_rows: Optional[tuple] = None  # (query, key, value) rows of the fused QKV (fused_qkv_rows(cfg))


def _adamw(params, lr: float, eps: float):
    return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=0.01)


def run_serial(
    fields: dict,
    batches: list,
    *,
    state: Optional[dict] = None,
    lr: float = 1e-3,
    adam_eps: float = 1e-8,
    logits=False,
    micro_batches: int = 1,
) -> Run:
    """ReferenceGPT of `fields` (its own seeded init, or `state`) through the batches; micro_batches:
    each batch's gradient accumulated over that many equal parts, each loss weighted 1 / m (a pipeline
    layout's micro-batches: an MoE load-balancing loss is the micro-batch's, as Megatron's). adam_eps:
    AdamW's eps (a larger one bounds how far a step moves for a gradient difference δ by lr·δ/eps, where
    at 1e-8 an element whose gradient is near 0 turns rounding into ~lr: tests/test_moe_parallel.py)."""
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.reference import ReferenceGPT

    cfg = GPTConfig(**fields)
    model = ReferenceGPT(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    if state is not None:
        model.load_state_dict(state)
    first = _logits(model, batches[0]) if logits else None
    opt, losses, grads0, norm0 = _adamw(model.parameters(), lr, adam_eps), [], None, None
    for step, batch in enumerate(batches):
        opt.zero_grad()
        loss = 0.0
        for micro in (batch.part(i, micro_batches) for i in range(micro_batches)):
            micro_loss = model(micro.tokens, micro.labels, **micro.inputs()) / micro_batches
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            norm0 = torch.stack([g.norm() for g in grads0.values()]).norm().item()
        losses.append(loss.item())
        opt.step()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    return Run(init, losses, grads0, norm0, final, first, {}, *_described(cfg))


@torch.no_grad()
def _logits(model, batch: Batch) -> torch.Tensor:
    """[B, s, V] logits of the batch (dropout off: the function itself)."""
    was = model.training
    model.eval()
    out = model(batch.tokens, **batch.inputs())
    model.train(was)
    return out[..., : model.cfg.vocab_size].clone()


def run_layout(
    fields: dict,
    layout: Layout,
    batches: list,
    *,
    state: Optional[dict] = None,
    lr: float = 1e-3,
    adam_eps: float = 1e-8,
    logits: bool = False,
    prepare: Optional[Callable] = None,
    probe: Optional[Callable] = None,
    fsdp: bool = False,
) -> Optional[Run]:
    """On every rank of a world of gloo ranks: the parallel model of `fields` at `layout` (loading
    `state` if given) through the batches (lr, adam_eps: run_serial's). prepare(model): called once
    built (e.g. compile it); probe(model, ps) -> dict: called after the steps, kept in Run.extra;
    logits: the first batch's, before training (not under pipeline parallelism); fsdp: the model
    sharded by --use-torch-fsdp2's fully_shard (distributed/fsdp.py) after those, its gradients reduced
    by FSDP2 and FSDPOptimizer.
    Returns the Run on the ranks of data-parallel and context-parallel rank 0 (one per TP rank), None
    elsewhere."""
    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig

    cfg = GPTConfig(**{**fields, **layout.config_fields()})
    levels = getattr(cfg, "hierarchical_context_parallel_sizes", None)  # a2a+p2p's CP groups (its field)
    ps = parallel_state.initialize_model_parallel(
        layout.tp,
        layout.cp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
        **({} if levels is None else {"hierarchical_context_parallel_sizes": levels}),
    )
    if ps.dp_size % layout.dp:
        raise ValueError(f"layout {layout} asks dp{layout.dp}, which does not divide the {ps.dp_size} replicas.")
    model = _build(cfg, layout, ps)
    init = model.full_state_dict()
    if state is not None:
        model.load_full_state_dict(state)
    if prepare is not None:
        prepare(model)
    first = _logits(model, batches[0]) if logits and layout.pp == 1 else None
    losses, grads0, norm0, final = (_fsdp_steps if fsdp else _steps)(model, layout, batches, ps, lr, adam_eps)
    extra = probe(model, ps) if probe is not None else {}
    if ps.dp_rank != 0 or ps.cp_rank != 0:
        return None
    return Run(init, losses, grads0, norm0, final, first, extra, *_described(cfg))


def _steps(model, layout: Layout, batches: list, ps, lr: float, eps: float) -> tuple:
    """(losses, first gradients, their norm, final weights) of AdamW steps on the batches."""
    from megatron_sp.distributed.optimizer import global_grad_norm

    opt, losses, grads0, norm0 = _adamw(model.parameters(), lr, eps), [], None, None
    for step, batch in enumerate(batches):
        opt.zero_grad()
        part = batch.part(ps.dp_rank % layout.dp, layout.dp)  # further replicas repeat the parts
        loss = _forward_backward(model, part, layout)
        _reduce_grads(model, ps)
        if step == 0:
            grads0, norm0 = model.full_grad_dict(), global_grad_norm(list(model.parameters()), ps).item()
        losses.append(_mean_over_replicas(loss, ps))
        opt.step()
    return losses, grads0, norm0, model.full_state_dict()


def _fsdp_steps(model, layout: Layout, batches: list, ps, lr: float, eps: float) -> tuple:
    """_steps with the model sharded by fully_shard (dense parameters over DP×CP, experts over
    expert-DP): FSDP2 reduce-scatters, FSDPOptimizer sums what remains; the norm is the training loop's."""
    from megatron_sp.distributed.fsdp import FSDPOptimizer, shard_model
    from megatron_sp.distributed.optimizer import global_grad_norm

    shard_model(model, ps, "cpu")
    flat = lambda groups: _adamw([p for g in groups for p in g["params"]], lr, eps)  # noqa: E731 (one decay, as the oracle's)
    opt, losses, grads0, norm0 = FSDPOptimizer(model, ps, flat, 0.01), [], None, None
    for step, batch in enumerate(batches):
        opt.zero_grad()
        loss = _forward_backward(model, batch.part(ps.dp_rank % layout.dp, layout.dp), layout)
        opt.finalize_grads(model, ps)
        if step == 0:
            grads0 = _gathered_dict(model, ps, lambda p: p.grad)
            norm0 = global_grad_norm(opt.local_params(), ps, opt.partition).item()
        losses.append(_mean_over_replicas(loss, ps))
        opt.step()
    return losses, grads0, norm0, _gathered_dict(model, ps, lambda p: p.detach())


@torch.no_grad()
def _gathered_dict(model, ps, tensor_of) -> dict:
    """Collective: tensor_of(p) (a DTensor sharded by FSDP2) of every parameter, unsharded as
    full_state_dict's (over FSDP2's mesh, then TP or expert-TP, then the experts over EP)."""
    from megatron_sp.models.moe.state import gather_experts
    from megatron_sp.tensor_parallel.sharding import gather_full

    full = {}
    for name, p in model.named_parameters():
        if tensor_of(p) is not None:
            full[name] = gather_full(tensor_of(p).full_tensor(), p.shard_spec, ps.group(p.shard_spec.group))
    return gather_experts(full, ps, model.cfg.num_experts)


def _described(cfg) -> tuple:
    """Run's fields that describe the model (how its weights after the steps are compared)."""
    return bool(cfg.layernorm_zero_centered_gamma), fused_qkv_rows(cfg)


def _build(cfg, layout: Layout, ps):
    if layout.pp == 1:
        from megatron_sp.models.gpt import GPTModel

        return GPTModel(cfg, ps)
    from megatron_sp.pipeline_parallel.model import PipelineGPT

    return PipelineGPT(cfg, layout.pipeline_layout(), ps)


def _forward_backward(model, batch: Batch, layout: Layout) -> torch.Tensor:
    """The batch's mean loss, its gradients accumulated (PP: pp micro-batches of equal size)."""
    if layout.pp == 1:
        loss = model(batch.tokens, batch.labels, **batch.inputs())
        loss.backward()
        return loss.detach()
    return model.step(batch.tokens, batch.labels, num_microbatches=layout.pp, **batch.inputs()).mean()


@torch.no_grad()
def _reduce_grads(model, ps) -> None:
    """What the training loop does before a step: the partial sums over TP and CP, the tied
    pipeline copy, and the data-parallel mean."""
    import torch.distributed as dist

    from megatron_sp.parallel_state import REPLICAS, replica_role

    model.partial_grads.reduce(model.parameters())
    model.finalize_embedding_grads()  # (PipelineGPT's tied copies; nothing on GPTModel)
    if ps.dp_size > 1:  # (experts': taken by partial_grads, over the expert-DP group)
        for p in model.parameters():
            if p.grad is not None and replica_role(p) == REPLICAS:
                dist.all_reduce(p.grad, group=ps.dp_group)
                p.grad /= ps.dp_size


def _mean_over_replicas(loss: torch.Tensor, ps) -> float:
    import torch.distributed as dist

    if ps.dp_size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=ps.dp_group)
        loss /= ps.dp_size
    return loss.item()


# ---- the differences ---------------------------------------------------------------------------


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (b: the reference)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def without_key_bias(name: str, value: torch.Tensor, rows: Optional[tuple] = None) -> torch.Tensor:
    """The key part of a QKV bias has an exactly zero gradient (softmax is shift-invariant), so
    AdamW turns fp32 rounding noise (~1e-10) into steps of ±lr there in both models alike: the
    weights after the steps are compared without it (a function-neutral difference). rows: the
    (query, key, value) rows of the fused bias (default: thirds, multi-head attention)."""
    if not name.endswith("attn.qkv.bias"):
        return value
    q, _, v = value.split(list(rows)) if rows is not None else value.chunk(3)
    return torch.cat([q, v])


def fused_qkv_rows(cfg) -> tuple:
    """(query, key, value) rows of cfg's fused QKV projection."""
    d = cfg.kv_channels
    return (cfg.num_attention_heads * d, cfg.num_query_groups * d, cfg.num_query_groups * d)


def _no_gradient(name: str) -> bool:
    """A LayerNorm k-norm's bias shifts every key alike: softmax-invariant, no gradient at all."""
    return name.endswith("attn.k_norm.bias")


@dataclass(frozen=True)
class Row:
    """One layout against the oracle: each difference is relative; `worst_*` name the parameter."""

    layout: str
    init: Optional[str]  # the first parameter whose initial value differs from the oracle's, if any
    loss: float  # the largest over the steps
    grad: float
    worst_grad: str
    grad_norm: float
    params: float
    worst_params: str
    missing: tuple = ()  # parameters one side has and the other lacks

    def failures(self, tolerances: dict = TOLERANCES) -> list:
        """What exceeds its tolerance, in words ([] when the layout computes the oracle's function)."""
        out = [f"parameters {', '.join(self.missing)} on one side only"] if self.missing else []
        if self.init is not None:
            out.append(f"initial {self.init} differs")
        for what, value, name in (
            ("loss", self.loss, ""),
            ("grad", self.grad, self.worst_grad),
            ("grad_norm", self.grad_norm, ""),
            ("params", self.params, self.worst_params),
        ):
            if not value <= tolerances[what]:  # NaN fails too
                out.append(f"{what} {value:.2e} > {tolerances[what]:.0e}" + (f" ({name})" if name else ""))
        return out


def _worst(pairs) -> tuple[float, str]:
    worst = (0.0, "")
    for name, value in pairs:
        if not value <= worst[0]:
            worst = (value, name)
    return worst


def compare(oracle: Run, run: Run, layout) -> Row:
    """The Row of `run` (a layout's, or another model's) against `oracle`."""
    names = set(oracle.grads0) | set(run.grads0) | set(oracle.final) | set(run.final)
    missing = tuple(sorted(n for n in names if not (n in oracle.final and n in run.final)))
    changed = (n for n in sorted(oracle.init) if n in run.init and not torch.equal(run.init[n], oracle.init[n]))
    init = next(changed, None)
    loss = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(run.losses, oracle.losses))
    grads = [(n, rel(run.grads0[n], g)) for n, g in oracle.grads0.items() if n in run.grads0 and not _no_gradient(n)]
    params = [(n, _rel_final(n, run, oracle)) for n in sorted(oracle.final) if n in run.final and not _no_gradient(n)]
    return Row(
        str(layout),
        init,
        loss,
        *_worst(grads),
        abs(run.norm0 - oracle.norm0) / max(oracle.norm0, 1e-30),
        *_worst(params),
        missing,
    )


def _rel_final(name: str, run: Run, oracle: Run) -> float:
    rows = oracle.qkv_rows
    got, want = without_key_bias(name, run.final[name], rows), without_key_bias(name, oracle.final[name], rows)
    if oracle.zero_centered and oracle.init[name].count_nonzero() == 0:
        got, want = got + 1.0, want + 1.0  # the gamma applied, not AdamW's steps away from 0
    return rel(got, want)
