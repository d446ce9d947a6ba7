"""The training loop's part of mixture of experts: per step, the routers' global_aux_loss counts
restart, the expert biases move after the step (aux-loss-free balancing), and the auxiliary losses
are reduced for the log (Megatron's track_moe_metrics).

Logged values, each without its coefficient (Megatron's): the loss of every layer, averaged over the
step's micro-batches; the record's `load_balancing_loss` (or seq_/global_), `z_loss` are their means
over the MoE layers, and `moe_layers` (--moe-per-layer-logging) holds `moe/<name>_layer_<l>` for each.
A rank's attached shares (models/moe/losses.py) add up over the stage's ranks to DP times the loss of
the micro-batch, so the sum over the stage divided by DP is the serial model's loss at every layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.layer_options import is_moe_layer
from megatron_sp.models.moe.losses import recorded_losses
from megatron_sp.models.moe.router import Router
from megatron_sp.parallel_state import collective_device


def routers(model) -> list:
    return [m for m in model.modules() if isinstance(m, Router)]


def start_step(model) -> None:
    for router in routers(model):
        router.reset_step()


def finish_step(model, ps, per_layer: bool = False) -> dict:
    """After the optimizer step: the expert biases' update, and the step's losses for the record (the
    same on every rank: under pipeline parallelism each stage's layers' are summed over the pipeline,
    as Megatron's track_moe_metrics reduces them over its pipeline group)."""
    found = routers(model)
    for router in found:
        if router.expert_bias is not None:
            router.update_expert_bias()
    entries = _entries(model.cfg)
    if not entries:
        return {}
    sums = _reduced_sums(found, entries, ps)
    by_name, layers = {}, {}
    for (layer, name), (value, seen) in zip(entries, sums.tolist()):
        if not seen:  # (a router that recorded nothing this step: none in training)
            continue
        plain = value / ps.dp_size / _coeff(model.cfg, name)
        by_name.setdefault(name, []).append(plain)
        layers[f"moe/{name}_layer_{layer}"] = plain
    out = {name: sum(v) / len(v) for name, v in by_name.items()}
    if per_layer and out:
        out["moe_layers"] = layers
    return out


def _entries(cfg) -> list:
    """(layer, loss name) of every MoE layer of the whole model (1-based layers, every stage's)."""
    if cfg.num_experts is None:
        return []
    names = recorded_losses(cfg)
    return [(layer, n) for layer in range(1, cfg.num_layers + 1) if is_moe_layer(cfg, layer) for n in names]


def _reduced_sums(found, entries, ps) -> torch.Tensor:
    """[entries, 2]: each entry's step mean of the attached shares summed over the stage's ranks, and
    whether any rank recorded it, reduced over the pipeline (the other stages' entries are theirs)."""
    at = {entry: i for i, entry in enumerate(entries)}
    sums = torch.zeros(len(entries), 2, dtype=torch.float32, device=collective_device())
    for router in found:
        for name, (total, count) in router.step_losses.items():
            sums[at[(router.layer, name)]] = torch.stack([(total / count).to(sums), torch.ones((), device=sums.device)])
    if ps.stage_group is not None:
        dist.all_reduce(sums, group=ps.stage_group)
    if ps.pp_size > 1:
        dist.all_reduce(sums, group=ps.pp_group)
    return sums


def _coeff(cfg, name: str) -> float:
    return cfg.moe_z_loss_coeff if name == "z_loss" else cfg.moe_aux_loss_coeff
