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
    with the training's on the default group (created once, by every rank at the same save)."""
    if not dist.is_initialized():
        return None
    if not _SAVE_GROUP:
        _SAVE_GROUP.append(dist.new_group(backend="gloo"))
    return _SAVE_GROUP[0]
