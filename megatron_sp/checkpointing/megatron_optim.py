"""A Megatron-LM checkpoint's optimizer state in (pretrain_gpt_sp.py --load of a Megatron-LM run).

    optimizer_layout(common, path) -> Layout     what it holds (no tensors read): .readable, .what
    check_optimizer(common, path, args)          its AdamW hyperparameters against the command line's
    read_optimizer(path, cfg, padded_vocab, common) -> MegatronAdam   moments, fp32 main weights, step
                                                 (ReferenceGPT names and shapes)
    load_optimizer(state, optimizer, model)      into our optimizer (distributed/optimizer.py), this rank's

Read: a torch_dist checkpoint whose optimizer state is one global tensor per parameter under the
model's own keys, `optimizer.state.{exp_avg,exp_avg_sq}.<model key>`, with the fp32 main weights where
the optimizer keeps them apart from the model's (`optimizer.state.fp32_param.<model key>`, or
`optimizer.state.param.<model key>` for the distributed optimizer) and the step count from the common
state (`optimizer.state.common_step`, or the param groups' `step`; one value for all, or refused):

    megatron-core 0.16.1 optimizer (Megatron-LM flags)                   tested (tests/megatron_fixtures.py)
    FP32Optimizer (torch_dist, no --use-distributed-optimizer)           step parity 6e-8
    Float16OptimizerWithFloat16Params (--bf16 / --fp16): + fp32_param     --bf16: main weights 5.5e-6
    DistributedOptimizer, --dist-ckpt-optim-fully-reshardable: + param   at TP2, read at TP1: 6e-8

(parity: the largest difference of our weights after step 11 from megatron-core's own step 11 on the
same samples; the update is ~3e-4). Each tensor goes through the weights' own mapping (megatron_files.py's
unstacking of layers and experts, megatron_model.py's to_ours: QKV per query group, the vocab padding
cut, TE norm names), then is sharded as the parameter it belongs to (shard_full, as
load_full_state_dict shards the weights). AdamW's betas and epsilon must be the command line's (the
refusal names the flag); the learning rate and weight decay follow the schedule (megatron_resume.py);
--fp16's loss scale starts fresh.

Not read (the refusal names the layout; --no-load-optim starts AdamW fresh, as Megatron-LM's own): the
distributed optimizer's default dp_reshardable (`optimizer.distributed.dp_group_idx_N.*`: flat gradient
buckets in Megatron's bucket order and padding, tested) and legacy `distrib_optim.pt`; the legacy torch
format's `optimizer` (a torch state dict keyed by a parameter's index in Megatron's parameter groups);
a ChainedOptimizer's prefixed entries (`chained_<i>.optimizer.*`, Megatron-LM before
chained_optim_avoid_prefix). fully_sharded_model_space (deprecated) cannot be written by megatron-core
0.16.1 (its save raises "ShardedTensor.flattened_range is not supported"); an older one's per-rank
flattened ranges are not known to be read correctly (untested).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_sp.checkpointing.megatron_files import _dist_metadata, read_torch_dist
from megatron_sp.checkpointing.megatron_model import to_ours
from megatron_sp.checkpointing.paths import CheckpointError
from megatron_sp.checkpointing.safe_dcp import METADATA_FILE

_STATE = "optimizer.state."
MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN = ("fp32_param", "param")  # Float16OptimizerWithFloat16Params's, the distributed optimizer's


@dataclass
class Layout:
    readable: bool
    what: str  # in Megatron-LM's terms, for messages


@dataclass
class MegatronAdam:
    """AdamW's state of a Megatron-LM checkpoint in ReferenceGPT's names and shapes."""

    exp_avg: dict
    exp_avg_sq: dict
    main: dict | None  # fp32 main weights (None: the model's weights are the fp32 ones)
    step: int


def optimizer_layout(common: dict, path: str) -> Layout:
    """What optimizer state an iteration directory holds, and whether megatron_sp reads it."""
    if os.path.lexists(os.path.join(path, METADATA_FILE)):
        keys = list(_dist_metadata(path).state_dict_metadata)
        if any(k.startswith(_STATE) for k in keys):
            kinds = {k[len(_STATE) :].partition(".")[0] for k in keys if k.startswith(_STATE)}
            main = " and fp32 main weights" if kinds & set(MAIN) else ""
            return Layout(True, f"AdamW moments{main} under the model's keys (optimizer.state.*)")
        if any(k.startswith("optimizer.distributed.") for k in keys):
            return Layout(
                False, "the distributed optimizer's bucket-space state (optimizer.distributed.*: dp_reshardable)"
            )
        if any(k.startswith("chained_") and ".optimizer." in k for k in keys):
            return Layout(False, "a chained optimizer's prefixed state (chained_<i>.optimizer.*)")
        if any(k.startswith("optimizer.") for k in keys):
            return Layout(False, "optimizer state in a layout megatron_sp does not know (optimizer.*)")
        return Layout(False, "no optimizer state (--no-save-optim)")
    if any(os.path.isfile(os.path.join(path, d, "distrib_optim.pt")) for d in os.listdir(path)):
        return Layout(False, "the distributed optimizer's distrib_optim.pt (bucket-space)")
    if "optimizer" in common:
        return Layout(False, "a non-distributed optimizer's state dict (by parameter index)")
    return Layout(False, "no optimizer state (--no-save-optim)")


def _walk(saved) -> list:
    """Every optimizer's state dict in the common state's `optimizer` entry: one optimizer's, a
    Float16OptimizerWithFloat16Params's or a distributed optimizer's {"optimizer": ...}, or a
    ChainedOptimizer's {0: ..., 1: ...}."""
    if not isinstance(saved, dict):
        return []
    if any(isinstance(k, int) for k in saved):
        return [d for k in sorted(k for k in saved if isinstance(k, int)) for d in _walk(saved[k])]
    return [saved] + _walk(saved.get("optimizer"))


def _groups(saved) -> list:
    """The param_groups of every optimizer in the common state's `optimizer` entry."""
    return [g for d in _walk(saved) for g in d.get("param_groups") or [] if isinstance(g, dict)]


def _step(saved, path: str) -> int:
    """The one step count of every optimizer: `state.common_step`, or the param groups' `step`."""
    found = set()
    for part in _walk(saved):
        state = part.get("state")
        if isinstance(state, dict) and "common_step" in state:
            found.add(int(torch.as_tensor(state["common_step"]).item()))
    for group in _groups(saved):
        if group.get("step") is not None:
            found.add(int(torch.as_tensor(group["step"]).item()))
    if len(found) != 1:
        raise CheckpointError(
            f"{path} holds optimizer state with {'no' if not found else 'several'} step counts "
            f"({sorted(found)}): its AdamW bias correction cannot be carried over."
        )
    return found.pop()


def check_optimizer(common: dict, path: str, args) -> None:
    """The checkpoint's AdamW betas and epsilon must be this run's: Megatron-LM's resume keeps the
    checkpoint's (torch's load_state_dict restores them), ours takes --adam-beta1/2 and --adam-eps."""
    for group in _groups(common.get("optimizer")):
        betas, eps = group.get("betas"), group.get("eps")
        if betas is not None and tuple(float(b) for b in betas) != (args.adam_beta1, args.adam_beta2):
            _refuse_hyper(
                path, f"betas {tuple(betas)}", f"--adam-beta1 {args.adam_beta1} --adam-beta2 {args.adam_beta2}"
            )
        if eps is not None and float(eps) != args.adam_eps:
            _refuse_hyper(path, f"eps {eps}", f"--adam-eps {args.adam_eps}")
    _step(common.get("optimizer"), path)


def _refuse_hyper(path: str, saved: str, ours: str):
    raise CheckpointError(
        f"Megatron-LM checkpoint {path} was trained with AdamW {saved} but this run has {ours}; pass the "
        f"checkpoint's, or --no-load-optim to start AdamW fresh."
    )


def read_optimizer(path: str, cfg, padded_vocab: int, common: dict) -> MegatronAdam:
    """The AdamW state of a torch_dist directory whose layout is readable (optimizer_layout)."""
    keys = {
        k[len(_STATE) :].partition(".")[0] for k in _dist_metadata(path).state_dict_metadata if k.startswith(_STATE)
    }
    unknown = sorted(keys - set(MOMENTS) - set(MAIN))
    if unknown or not set(MOMENTS) <= keys or len(keys & set(MAIN)) > 1:
        what = f"optimizer.state.{unknown[0]}.*" if unknown else f"the optimizer.state entries {sorted(keys)}"
        raise CheckpointError(
            f"{path} holds {what}, which is not AdamW's state (exp_avg, exp_avg_sq, fp32 main weights)."
        )
    tensors = {}
    for kind in sorted(keys):
        ckpt = read_torch_dist(path, f"{_STATE}{kind}.")
        tensors[kind] = to_ours(ckpt.tensors, cfg, padded_vocab, f"{path} ({_STATE}{kind})", parameters_only=True)
    main = next((tensors[k] for k in MAIN if k in tensors), None)
    return MegatronAdam(tensors["exp_avg"], tensors["exp_avg_sq"], main, _step(common.get("optimizer"), path))


@torch.no_grad()
def load_optimizer(state: MegatronAdam, optimizer, model) -> None:
    """Into our MixedPrecisionOptimizer (distributed/optimizer.py): for each parameter it steps, its
    share of the moments (and of the fp32 main weights), sharded as the parameter is, and the step."""
    from megatron_sp.models.gpt import _full_shape
    from megatron_sp.tensor_parallel.sharding import shard_full

    ps = model.ps
    fused = any(g.get("fused") or g.get("capturable") for g in optimizer.optim.param_groups)
    names = {id(p): n for n, p in model.named_parameters()}

    def local(full: dict, name: str, p) -> torch.Tensor:
        t = full[name]
        if tuple(t.shape) != _full_shape(p, ps):
            raise CheckpointError(f"the Megatron-LM optimizer state of {name} is {list(t.shape)}, not the model's.")
        return shard_full(t.to(p.device), p.shard_spec, tuple(p.shape), *ps.coords(p.shard_spec.group))

    for p, main in optimizer.pairs:
        name = names[id(p)]
        if state.main is not None:
            main.copy_(local(state.main, name, p))
        optimizer.optim.state[main] = {
            "step": torch.tensor(float(state.step), dtype=torch.float32, device=main.device if fused else "cpu"),
            "exp_avg": local(state.exp_avg, name, p).to(main.dtype),
            "exp_avg_sq": local(state.exp_avg_sq, name, p).to(main.dtype),
        }
