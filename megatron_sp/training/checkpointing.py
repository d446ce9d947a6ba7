"""Checkpoints in torch.distributed.checkpoint (DCP) format that load at any TP size.

Layout of --save DIR:
    DIR/iter_0000010/            one checkpoint: DCP shards (*.distcp, .metadata), rng_rank*.pt,
                                 metadata.json (config, TP/DP sizes, iteration, tokens seen)
    DIR/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint

Atomicity: a checkpoint is written into `iter_N.tmp` and renamed to `iter_N` only after every rank
has finished; the `latest` marker is replaced (os.replace) last. A process killed during a save
leaves the previous checkpoint and marker untouched.

Resharding: each TP-sharded tensor is stored as its slice of one canonical global tensor (see
canonical.py), declared to DCP with its global offsets (a ShardedTensor), so DCP reads back any
other slicing: save at TP=2, load at TP=1 or TP=4. Replicated tensors are plain tensors (DCP
writes one copy). Data-parallel replicas declare the same slices; DCP de-duplicates them.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_sp.training.canonical import empty_dcp_target, from_canonical_local, to_dcp_tensor

LATEST = "latest_checkpointed_iteration.txt"


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, incomplete, incompatible): one sentence."""


def _dcp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp
    return dcp


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest(root: str):
    """Iteration named by the latest marker, or None when the directory holds no checkpoint."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} does not hold an iteration number ({text!r}); fix or delete it.")
    return int(text)


# ---- state dicts -------------------------------------------------------------------------------

def _model_items(trainer):
    ps = trainer.ps
    for name, p in trainer.model.named_parameters():
        yield name, p, ps


def build_state(trainer, with_optim: bool):
    """The DCP state dict of this rank: model (and optimizer) tensors in canonical layout."""
    state = {"model": {}, "optim": {}}
    for name, p, ps in _model_items(trainer):
        state["model"][name] = to_dcp_tensor(p.detach(), p, ps)
        if with_optim:
            st = trainer.optimizer.state.get(p, {})
            state["optim"][name] = {
                "exp_avg": to_dcp_tensor(st.get("exp_avg", torch.zeros_like(p)), p, ps),
                "exp_avg_sq": to_dcp_tensor(st.get("exp_avg_sq", torch.zeros_like(p)), p, ps),
                "step": torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).cpu().clone()}
    if not with_optim:
        del state["optim"]
    return state


def _target_state(trainer, with_optim: bool):
    """Empty tensors shaped like this rank's slices, for DCP to fill."""
    state = {"model": {n: empty_dcp_target(p, ps) for n, p, ps in _model_items(trainer)}}
    if with_optim:
        state["optim"] = {n: {"exp_avg": empty_dcp_target(p, ps),
                                              "exp_avg_sq": empty_dcp_target(p, ps),
                                              "step": torch.zeros((), dtype=torch.float32)}
                          for n, p, ps in _model_items(trainer)}
    return state


# ---- save --------------------------------------------------------------------------------------

def save(args, trainer) -> str:
    """Collective. Writes iter_N atomically and then moves the latest marker to it."""
    root, it = args.save, trainer.state.iteration
    final, tmp = checkpoint_dir(root, it), checkpoint_dir(root, it) + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)             # leftovers of a killed save
        os.makedirs(tmp)
    _barrier()
    state = build_state(trainer, with_optim=True)
    _dcp().save(state, checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{_rank()}.pt"))
    if _rank() == 0:
        _write_json(os.path.join(tmp, "metadata.json"), _metadata(args, trainer))
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_text_atomic(os.path.join(root, LATEST), str(it))
    _barrier()
    trainer.log.info(f" saved checkpoint at iteration {it} to {final}")
    return final


def _metadata(args, trainer) -> dict:
    return {"iteration": trainer.state.iteration, "train_state": asdict(trainer.state),
            "tokens_seen": trainer.state.consumed_train_samples * args.seq_length,
            "tensor_model_parallel_size": trainer.ps.tp_size, "data_parallel_size": trainer.ps.dp_size,
            "sequence_parallel": trainer.cfg.sequence_parallel, "config": asdict(trainer.cfg),
            "loss_scale": trainer.scaler.state_dict() if trainer.scaler else None,
            "format": "megatron_sp-dcp-1"}


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def _write_text_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state():
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# ---- load --------------------------------------------------------------------------------------

def load(args, trainer) -> None:
    """Collective. Restores model, optimizer, LR schedule position, RNG and data position from the
    latest checkpoint in --load (weights only with --finetune)."""
    path, meta = _locate(args.load)
    if path is None:
        trainer.log.info(f" no checkpoint in {args.load}: starting from scratch")
        return
    _check_compatible(meta, trainer.cfg, path)
    with_optim = not (args.finetune or args.no_load_optim)
    if with_optim and not _has_optimizer_state(path):
        trainer.log.info(f" {path} holds no optimizer state (converted weights?): the optimizer starts fresh")
        with_optim = False
    state = _target_state(trainer, with_optim)
    _dcp().load(state, checkpoint_id=path)
    _restore_model(trainer, state["model"])
    if with_optim:
        _restore_optim(trainer, state["optim"])
    if not args.finetune:
        trainer.state = TrainState(**meta["train_state"])
        if trainer.scaler and meta.get("loss_scale"):
            trainer.scaler.load_state_dict(meta["loss_scale"])
        rng = os.path.join(path, f"rng_rank{_rank()}.pt")
        if not args.no_load_rng and os.path.exists(rng):
            _restore_rng(torch.load(rng, weights_only=False))
    trainer.log.info(f" loaded checkpoint {path} (saved at TP={meta['tensor_model_parallel_size']}, "
                     f"iteration {meta['iteration']}){' for finetuning' if args.finetune else ''}")


def _locate(root: str):
    if not os.path.isdir(root):      # first submission of `--save X --load X`: nothing yet (Megatron)
        return None, None
    it = read_latest(root)
    if it is None:
        return None, None
    path = checkpoint_dir(root, it)
    meta_path = os.path.join(path, "metadata.json")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"checkpoint {path} named by {LATEST} is missing or incomplete.")
    return path, json.load(open(meta_path))


def _has_optimizer_state(path) -> bool:
    meta = _dcp().FileSystemReader(path).read_metadata().state_dict_metadata
    return any(key.startswith("optim.") for key in meta)


def _check_compatible(meta, cfg, path):
    saved = meta["config"]
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                "max_position_embeddings"):
        if saved.get(key) != getattr(cfg, key):
            raise CheckpointError(f"checkpoint {path} has {key}={saved.get(key)} but the model has "
                                  f"{getattr(cfg, key)}; use the same model flags as the saved run.")


@torch.no_grad()
def _restore_model(trainer, tensors):
    for name, p, ps in _model_items(trainer):
        p.copy_(from_canonical_local(tensors[name], p, ps))


@torch.no_grad()
def _restore_optim(trainer, tensors):
    fused = any(g.get("fused") or g.get("capturable") for g in trainer.optimizer.param_groups)
    for name, p, ps in _model_items(trainer):
        saved = tensors[name]
        step_device = p.device if fused else "cpu"
        trainer.optimizer.state[p] = {
            "step": saved["step"].to(step_device),
            "exp_avg": from_canonical_local(saved["exp_avg"], p, ps).to(p.dtype),
            "exp_avg_sq": from_canonical_local(saved["exp_avg_sq"], p, ps).to(p.dtype)}


def _restore_rng(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
