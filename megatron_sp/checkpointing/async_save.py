"""--async-save's two halves that need no checkpointer state: a CPU snapshot of the state dicts
(taken while training waits) and DCP's save of it in a background thread, over a gloo process group
of its own so its collectives never interleave with the training's. The checkpointer finishes the
save (integrity record, rename, marker) once every rank's thread is done."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def snapshot(value):
    """A CPU copy of a state dict that training may go on changing (ShardedTensors rebuilt from their
    copied shards without a collective)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if isinstance(value, ShardedTensor):
        shards = [Shard(snapshot(s.tensor), s.metadata) for s in value.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, value.metadata(), process_group=value._process_group
        )
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    return value


def background_save(state_dict, tmp, dcp):
    """DCP's save of the snapshot in a thread, over a process group of its own; returns its future."""
    import concurrent.futures

    group = _save_group()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="async-save")

    def write():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state_dict, checkpoint_id=tmp, process_group=group)

    future = executor.submit(write)
    executor.shutdown(wait=False)
    return future


_SAVE_GROUP = []


def _save_group():
    """A gloo group of its own for the background writer's collectives, so they never interleave
    with the training's on the default group (created once, by every rank at the same save), with
    the world's timeout (--distributed-timeout-minutes): new_group would give it torch's 30 minutes,
    and the process's exit waits for this thread, so a dead peer would hold the exit that long."""
    if not dist.is_initialized():
        return None
    if not _SAVE_GROUP:
        _SAVE_GROUP.append(dist.new_group(backend="gloo", timeout=world_timeout()))
    return _SAVE_GROUP[0]


def world_timeout():
    """The default group's collective timeout (what init_process_group was given), or None."""
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - a private API: torch's default then
        return None
