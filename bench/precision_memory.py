"""Precision and memory (issue 17, 19.4): bytes per parameter per rank, bytes copied per training step
by the gradient sync and the optimizer, and the peak memory while building a model.

    python bench/precision_memory.py                        # bytes/param/rank and bytes copied, world 4
    python bench/precision_memory.py --build-memory         # peak while building ~165M params at TP 1/2/4

What is measured
----------------
bytes/param/rank: after one real step (training/loop.py train_step) on every rank of a gloo world of 4
with TP = 4 / r (so r = 1, 2, 4 data-parallel replicas), the tensor bytes a rank holds, divided by the
number of parameters it holds: the parameters (model dtype), the gradient buffers (param.main_grad:
fp32, bf16 with --grad-reduce-in-bf16), the fp32 main weights that are not the parameters themselves,
and the AdamW moments; beside Megatron's formulas (fp32 16; bf16 18; distributed 6 + 12/r, 4 + 12/r
with bf16 gradients; fp32 distributed 8 + 8/r).

bytes copied: a TorchDispatchMode sums the bytes written by the copying ops (copy_, _foreach_copy_,
cat, stack, clone, _to_copy) inside the gradient sync (finalize_model_grads) and the optimizer's
prepare_grads + step, fp32, TP 2 x DP 2, for the code it runs; run it against another tree (`git
archive main megatron_sp | tar -x -C DIR; PYTHONPATH=DIR python bench/precision_memory.py
--copies-only`) for the figure before the gradient buffers.

build memory: in a fresh world of t processes, each rank builds a tiny model first (so that the code
pages and allocator pools any build touches are resident), resets its peak RSS (/proc/self/clear_refs),
builds GPTModel (meta device, then its shard drawn in place), and reports the peak RSS growth beside
its shard's bytes.
"""

from __future__ import annotations

import argparse
import inspect

from _cli import table

from megatron_sp.testing import LocalWorld

COPY_OPS = ("copy_", "_foreach_copy_", "cat", "stack", "clone", "_to_copy")
MODES = {  # name: (params_dtype, distributed optimizer, bf16 gradient buffers)
    "fp32": ("fp32", False, False),
    "fp32 + dist-opt": ("fp32", True, False),
    "bf16": ("bf16", False, False),
    "bf16 + dist-opt": ("bf16", True, False),
    "bf16 + dist-opt + bf16 grads": ("bf16", True, True),
}


def megatron_formula(mode: str, r: int) -> float:
    dtype, distributed, bf16_grads = MODES[mode]
    if dtype == "fp32":
        return 8 + 8 / r if distributed else 16
    if not distributed:
        return 18
    return (4 if bf16_grads else 6) + 12 / r


def _config(tp, hidden, layers, dtype="fp32", vocab=4096, seq=64):
    from megatron_sp.config import GPTConfig

    return GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=8,
        vocab_size=vocab,
        seq_length=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        **({} if dtype == "fp32" else {"params_dtype": dtype}),  # (a tree before params_dtype: --copies-only)
    )


def _hyper(distributed, bf16_grads):
    from types import SimpleNamespace

    return SimpleNamespace(
        weight_decay=0.1,
        lr=1e-4,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        use_distributed_optimizer=distributed,
        grad_reduce_in_bf16=bf16_grads,
    )


def _batch(ps, vocab, seq):
    import torch

    g = torch.Generator().manual_seed(ps.dp_rank)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "sample_ids": torch.arange(2) + 2 * ps.dp_rank}


def bytes_worker(tp, hidden, layers):
    """{mode: bytes per parameter on this rank, by part} after one train_step."""
    from megatron_sp import parallel_state
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.training.loop import train_step

    ps = parallel_state.initialize_model_parallel(tp)
    out = {}
    for mode, (dtype, distributed, bf16_grads) in MODES.items():
        model = GPTModel(_config(tp, hidden, layers, dtype))
        opt = build_optimizer(model, _hyper(distributed, bf16_grads), "cpu", ps)
        batches = iter([_batch(ps, 4096, 64)])
        train_step(model, opt, batches, 1, ps, device="cpu", clip_grad=1.0, iteration=1)
        n = sum(p.numel() for p in model.parameters())
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        moments = [t for st in opt.optim.state.values() for k, t in st.items() if k != "step"]
        parts = dict(
            weights=nbytes(model.parameters()),
            grads=opt.grad_buffers.nbytes(),
            main=nbytes(main for p, main in opt.pairs if main is not p),
            moments=nbytes(moments),
        )
        out[mode] = {k: v / n for k, v in parts.items()}
    return out


def copies_worker(hidden, layers, steps=2):
    """Bytes written by copying ops per step in the gradient sync and in the optimizer, fp32, TP 2 x DP 2."""
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_sp import parallel_state
    from megatron_sp.distributed import grad_sync
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.models.gpt import GPTModel

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.name().split("::")[1].split(".")[0]
            if name in COPY_OPS:
                outs = out if isinstance(out, (list, tuple)) else [out]
                if name == "_foreach_copy_":
                    outs = args[0]
                self.bytes[name] += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            return out

    ps = parallel_state.initialize_model_parallel(2)
    model = GPTModel(_config(2, hidden, layers))
    opt = build_optimizer(model, _hyper(False, False), "cpu", ps)
    buffers = "buffers" in inspect.signature(grad_sync.finalize_model_grads).parameters  # the gradient buffers
    sync, step = Copies(), Copies()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        batch = _batch(ps, 4096, 64)
        model(batch["tokens"], batch["labels"], sample_ids=batch["sample_ids"]).backward()
        with sync:
            if buffers:
                grad_sync.finalize_model_grads(model, ps, opt.grad_buffers)
            else:
                grad_sync.finalize_model_grads(model, ps)
        with step:
            if hasattr(opt, "prepare_grads"):
                opt.prepare_grads()
            opt.step()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(
        sync={k: v / steps for k, v in sync.bytes.items()},
        step={k: v / steps for k, v in step.bytes.items()},
        grads=grads,
        buffers=buffers,
    )


def build_worker(tp, hidden, layers, vocab):
    """Peak RSS growth while building the TP model, this rank's shard bytes, and the RSS it kept."""
    from megatron_sp import parallel_state
    from megatron_sp.models.gpt import GPTModel

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

    parallel_state.initialize_model_parallel(tp)
    GPTModel(_config(tp, 64, 1, vocab=256, seq=64))  # warm-up: the code pages and allocator pools a build touches
    cfg = _config(tp, hidden, layers, vocab=vocab, seq=1024)
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak) to the current RSS
    model = GPTModel(cfg)
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(peak=status("VmHWM") - before, kept=status("VmRSS") - before, shard=shard)


def _bytes_table(world, hidden, layers):
    rows = []
    for tp in (4, 2, 1):
        r = 4 // tp
        ranks = world.run(bytes_worker, tp, hidden, layers)
        for mode in MODES:
            mean = {k: sum(x[mode][k] for x in ranks) / len(ranks) for k in ranks[0][mode]}
            worst = max(sum(x[mode].values()) for x in ranks)
            rows.append(
                [mode, r]
                + [f"{mean[k]:.2f}" for k in ("weights", "grads", "main", "moments")]
                + [f"{sum(mean.values()):.2f}", f"{worst:.2f}", f"{megatron_formula(mode, r):.2f}"]
            )
    print(
        f"bytes per parameter per rank (mean over the ranks; max: the rank holding most, whole parameters "
        f"being owned by one replica), hidden {hidden}, {layers} layers, TP = 4 / r"
    )
    print(table(["mode", "r", "weights", "grads", "main", "moments", "mean", "max rank", "Megatron"], rows))


def _copies_table(world, hidden, layers):
    res = world.run(copies_worker, hidden, layers)[0]
    g = res["grads"]
    print(
        f"\nbytes written by copying ops per step, fp32, TP 2 x DP 2, hidden {hidden}, {layers} layers; "
        f"the rank's gradients: {g / 1e6:.2f} MB ({'gradient buffers' if res['buffers'] else 'no gradient buffers'})"
    )
    rows = [
        [where, op, f"{v / 1e6:.3f}", f"{v / g:.3f}"]
        for where in ("sync", "step")
        for op, v in sorted(res[where].items())
    ]
    for where in ("sync", "step"):
        total = sum(res[where].values())
        rows.append([where, "total", f"{total / 1e6:.3f}", f"{total / g:.3f}"])
    print(table(["phase", "op", "MB", "x gradient bytes"], rows))


def _build_table(hidden, layers, vocab):
    rows = []
    for tp in (1, 2, 4):
        with LocalWorld(tp) as world:
            ranks = world.run(build_worker, tp, hidden, layers, vocab, timeout=3600)
        worst = max(ranks, key=lambda x: x["peak"] / x["shard"])
        rows.append(
            [
                tp,
                f"{worst['shard'] / 2**20:.1f}",
                f"{worst['peak'] / 2**20:.1f}",
                f"{worst['kept'] / 2**20:.1f}",
                f"{worst['peak'] / worst['shard']:.3f}",
                f"{(worst['peak'] - worst['shard']) / 2**20:.1f}",
            ]
        )
    print(f"peak RSS growth while building GPTModel, hidden {hidden}, {layers} layers, vocab {vocab}, fp32")
    print(table(["TP", "shard MiB", "peak growth MiB", "kept MiB", "peak / shard", "peak - shard MiB"], rows))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--copies-only", action="store_true", help="only the bytes copied per step")
    p.add_argument("--build-memory", action="store_true", help="only the peak while building (~165M params)")
    p.add_argument("--build-hidden-size", type=int, default=1024)
    p.add_argument("--build-num-layers", type=int, default=9)
    p.add_argument("--build-vocab-size", type=int, default=50304)
    a = p.parse_args()
    if a.build_memory:
        _build_table(a.build_hidden_size, a.build_num_layers, a.build_vocab_size)
        return
    with LocalWorld(4) as world:
        if not a.copies_only:
            _bytes_table(world, a.hidden_size, a.num_layers)
        _copies_table(world, a.hidden_size, a.num_layers)


if __name__ == "__main__":
    main()
