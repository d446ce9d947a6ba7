"""Resident memory per rank: plain data parallelism vs --use-torch-fsdp2 (ZeRO-3), 4 replicas on CPU.

    python bench/fsdp_memory.py                         # ~160M parameters: 12 layers, hidden 1024
    python bench/fsdp_memory.py --num-layers 2 --hidden-size 256 --steps 1   # a quick look
    python bench/fsdp_memory.py --pipeline-model-parallel-size 2   # PP2 x DP2: + the distributed optimizer

With --pipeline-model-parallel-size 2 the 4 ranks are 2 stages × 2 replicas (1F1B, 4 micro-batches): plain,
the distributed optimizer and FSDP2, whose stage stays gathered with unsharded fp32 gradients for the
step (torch.distributed.pipelining's FSDP2 schedule; formula 4/r + 4/r + 8/r, r = 2, plus 4 + 4 at peak).

Each mode runs in its own gloo world of 4 processes (peak resident memory is a process's whole life):
build the model and its optimizer (distributed/optimizer.py's replicated AdamW with gradient buffers, or
distributed/fsdp.py's), train `--steps` real steps (training/loop.py train_step, fp32, micro-batch 1), and
report per rank the peak resident set (ru_maxrss), the resident set before the model was built (torch's
own), and the bytes per parameter of the tensors it holds after a step (weights, gradients, AdamW moments),
beside the formula: plain 4 + 4 + 8, FSDP2 4/r + 4/r + 8/r (r = 4 replicas; each parameter's dim 0 is
padded to a multiple of r). Building the model still draws the TP-local initial tensors whole (4 bytes
per parameter for a moment) before fully_shard shards them.
"""

from __future__ import annotations

import argparse

from _cli import table

from megatron_sp.testing import LocalWorld


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _build(cfg, pp: int, ps):
    """GPTModel, or this rank's stage of a 1F1B pipeline (PipelineGPT)."""
    if pp == 1:
        from megatron_sp.models.gpt import GPTModel

        return GPTModel(cfg, ps)
    from megatron_sp.pipeline_parallel.layout import PipelineLayout
    from megatron_sp.pipeline_parallel.model import PipelineGPT

    return PipelineGPT(cfg, PipelineLayout(pp), ps)


def _measure(mode: str, layers: int, hidden: int, seq: int, steps: int, pp: int = 1) -> dict:
    import resource
    import time
    from types import SimpleNamespace

    import torch

    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.distributed.fsdp import build_fsdp_optimizer
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.training.loop import train_step

    torch.set_num_threads(1)
    fsdp = mode == "fsdp2"
    ps = parallel_state.initialize_model_parallel(1, 1, pipeline_model_parallel_size=pp)
    cfg = GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=16,
        vocab_size=8192,
        seq_length=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    before = _rss_mib()
    model = _build(cfg, pp, ps)
    args = SimpleNamespace(weight_decay=0.1, lr=1e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    args.use_distributed_optimizer = mode == "distributed"
    opt = build_fsdp_optimizer(model, args, "cpu", ps) if fsdp else build_optimizer(model, args, "cpu", ps)
    g = torch.Generator().manual_seed(ps.dp_rank)
    micro = 2 * pp if pp > 1 else 1  # (1F1B: at least pp micro-batches)
    batches = ({"tokens": torch.randint(0, 8192, (1, seq), generator=g)} for _ in range(steps * micro))
    data = ({"tokens": b["tokens"], "labels": b["tokens"].roll(-1, 1)} for b in batches)
    start = time.perf_counter()
    for step in range(steps):
        train_step(model, opt, data, micro, ps, device="cpu", clip_grad=1.0, iteration=step + 1)
    seconds = (time.perf_counter() - start) / steps
    local = (lambda t: t._local_tensor) if fsdp else (lambda t: t)
    nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    grads = [p.grad for p in model.parameters()] if fsdp else []
    moments = [t for st in opt.optim.state.values() for k, t in st.items() if k != "step"]
    return {
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "before": before,
        "params": sum(p.numel() for p in model.parameters()),  # (this rank's stage; a DTensor counts whole)
        "weights": nbytes(model.parameters()),
        "grads": nbytes(grads) if fsdp else opt.grad_buffers.nbytes(),
        "moments": nbytes(moments),
        "seconds": seconds,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--pipeline-model-parallel-size", type=int, choices=(1, 2), default=1)
    args = parser.parse_args()
    pp = args.pipeline_model_parallel_size
    rows, peaks, r = [], {}, 4 // pp
    names = {
        "plain": "plain DP" if pp == 1 else "plain",
        "distributed": "distributed optimizer",
        "fsdp2": "FSDP2 (ZeRO-3)",
    }
    formulas = {"plain": (4, 4, 8), "distributed": (4, 4, 8 / r), "fsdp2": (4 / r, 4 / r, 8 / r)}
    for mode in ("plain", "distributed", "fsdp2") if pp > 1 else ("plain", "fsdp2"):
        with LocalWorld(4) as world:
            ranks = world.run(_measure, mode, args.num_layers, args.hidden_size, args.seq_length, args.steps, pp)
        n = max(x["params"] for x in ranks)  # (the larger stage's)
        per = lambda key: max(x[key] for x in ranks) / n  # noqa: E731
        formula = formulas[mode]
        peaks[mode] = max(x["peak"] for x in ranks)
        rows.append(
            [
                names[mode],
                f"{n / 1e6:.1f}M",
                f"{max(x['before'] for x in ranks):.0f}",
                f"{peaks[mode]:.0f}",
                f"{per('weights'):.3f} ({formula[0]:g})",
                f"{per('grads'):.3f} ({formula[1]:g})",
                f"{per('moments'):.3f} ({formula[2]:g})",
                f"{max(x['seconds'] for x in ranks):.2f}",
            ]
        )
    layout = f"{r} replicas" if pp == 1 else f"PP{pp} x {r} replicas (1F1B, {2 * pp} micro-batches)"
    print(
        f"Per rank, {layout} (gloo, CPU, fp32): {args.num_layers} layers, hidden {args.hidden_size}, "
        f"seq {args.seq_length}, micro-batch 1; bytes/param of the rank's stage measured (formula)"
    )
    headers = ["mode", "params", "RSS before MiB", "peak RSS MiB", "weights B/p", "grads B/p", "AdamW B/p", "s/step"]
    print(table(headers, rows))
    print(", ".join(f"peak RSS {names[m]} / plain: {peaks[m] / peaks['plain']:.2f}" for m in peaks if m != "plain"))


if __name__ == "__main__":
    main()
