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

from megatron_sp.models.moe.router import Router


def routers(model) -> list:
    return [m for m in model.modules() if isinstance(m, Router)]


def start_step(model) -> None:
    for router in routers(model):
        router.reset_step()


def finish_step(model, ps, per_layer: bool = False) -> dict:
    """After the optimizer step: the expert biases' update, and the step's losses for the record."""
    found = routers(model)
    for router in found:
        if router.expert_bias is not None:
            router.update_expert_bias()
    entries = [(r, name) for r in found for name in sorted(r.step_losses)]
    if not entries:
        return {}
    values = torch.stack([r.step_losses[n][0] / r.step_losses[n][1] for r, n in entries])
    if ps.stage_group is not None:
        dist.all_reduce(values, group=ps.stage_group)
    values = (values / ps.dp_size).tolist()
    by_name, layers = {}, {}
    for (router, name), value in zip(entries, values):
        plain = value / _coeff(router.cfg, name)
        by_name.setdefault(name, []).append(plain)
        layers[f"moe/{name}_layer_{router.layer}"] = plain
    out = {name: sum(v) / len(v) for name, v in by_name.items()}
    if per_layer:
        out["moe_layers"] = layers
    return out


def _coeff(cfg, name: str) -> float:
    return cfg.moe_z_loss_coeff if name == "z_loss" else cfg.moe_aux_loss_coeff
