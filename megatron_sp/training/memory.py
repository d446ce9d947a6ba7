"""Running out of memory, in one sentence with the sizes: refused before the model is built when its
weights, gradients and AdamW state alone cannot fit (a lower bound: activations come on top), and
reported with the sizes when an allocation fails while running (instead of a worker's traceback).
"""

from __future__ import annotations

import os
import re
from typing import Optional

_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


class MemoryShortage(ValueError):
    """The model's state cannot fit in the memory this rank has: one sentence with the sizes."""


def is_out_of_memory(err: BaseException) -> bool:
    import torch

    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _MARKERS)


def state_bytes(cfg, args) -> int:
    """Bytes of weights, gradients and optimizer state on one rank, a lower bound (no activations, no
    buffers; with pipeline stages, the largest stage's share of at least 1/pp): Megatron's accounting
    per parameter, r = DP x CP replicas sharing the optimizer state with
    --use-distributed-optimizer (distributed/optimizer.py):
        fp32           4 weight + 4 gradient + 8 AdamW moments (/r)
        bf16 / fp16    2 weight + 4 gradient (2 with --grad-reduce-in-bf16) + 12 main weight and moments (/r)
        FSDP2          (4 + 4 + 8) / r, fp32 and bf16 (distributed/fsdp.py); with pipeline stages a stage
                       also holds its weights gathered (4, or 2 in bf16 / fp16) and its gradients
                       unsharded in fp32 (4) for the whole step
    """
    stages = max(1, getattr(args, "pipeline_model_parallel_size", 1))  # the largest stage holds >= 1/pp
    per_rank = cfg.num_parameters() // (max(1, args.tensor_model_parallel_size) * stages)
    replicas = max(1, args.data_parallel_size * getattr(args, "context_parallel_size", 1))
    low = getattr(args, "params_dtype", "fp32") != "fp32"
    if getattr(args, "use_torch_fsdp2", False):
        return int(per_rank * (16 / replicas + ((2 if low else 4) + 4 if stages > 1 else 0)))
    weight, grad = (2, 2 if getattr(args, "grad_reduce_in_bf16", False) else 4) if low else (4, 4)
    optim = 12 if low else 8
    if getattr(args, "use_distributed_optimizer", False):
        optim /= replicas
    return int(per_rank * (weight + grad + optim))


def available_bytes(device: str) -> Optional[int]:
    """Memory free for this rank: the CUDA device's free memory, or the host's available memory
    shared by the node's ranks (LOCAL_WORLD_SIZE); None when it cannot be told."""
    try:
        if device == "cuda":  # the GPU this rank will use (dist_env's choice), not GPU 0 for every rank
            import torch

            from megatron_sp.training.dist_env import detect_env

            index = detect_env().local_rank if torch.cuda.device_count() > 1 else 0
            return torch.cuda.mem_get_info(index)[0]
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except (OSError, KeyError, ValueError, IndexError, RuntimeError, AssertionError):
        return None


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_fits(cfg, args) -> None:
    """MemoryShortage when the model's state alone exceeds the memory this rank has."""
    need, free = state_bytes(cfg, args), available_bytes(args.device)
    if free is not None and need > free:
        raise MemoryShortage(
            f"the model's {cfg.num_parameters() / 1e6:.1f}M parameters need at least {_gb(need)} per rank for "
            f"weights, gradients and AdamW state but {args.device} has {_gb(free)} free: use a smaller model, "
            f"a larger --tensor-model-parallel-size, --use-distributed-optimizer or --use-torch-fsdp2."
        )


def _asked(err: BaseException) -> Optional[str]:
    """The allocation that failed, as torch's message gives it ('2.00 GiB', '123456 bytes')."""
    text = str(err)
    m = re.search(r"[Tt]ried to allocate ([0-9.]+ ?[KMGT]?i?B|[0-9]+ bytes)", text)
    return m.group(1) if m else None


def describe_out_of_memory(err: BaseException, cfg, args, rank: int) -> str:
    """One sentence for an allocation that failed while building or training the model."""
    free = available_bytes(args.device)
    asked = _asked(err)
    return (
        f"rank {rank}: out of memory on {args.device}"
        f"{f' allocating {asked}' if asked else ''}"
        f"{f' ({_gb(free)} free now)' if free is not None else ''}; the model has "
        f"{cfg.num_parameters() / 1e6:.1f}M parameters, at least {_gb(state_bytes(cfg, args))} per rank "
        f"before activations: use a smaller --micro-batch-size, --recompute-granularity full, a larger "
        f"--tensor-model-parallel-size or a smaller model."
    )
