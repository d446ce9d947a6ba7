"""AdamW state per rank and gradient-sync + step time: replicated vs --use-distributed-optimizer (ZeRO-1).

    python bench/optimizer_memory.py                       # world 4: (TP, CP) = (1, 1), (2, 1), (1, 2)
    python bench/optimizer_memory.py --hidden-size 512 --num-layers 8

What is measured, on every rank of a gloo CPU world: the bytes of the AdamW moments (exp_avg,
exp_avg_sq; the step counters are left out) and of the gradients each rank holds after a step, for
the replicated optimizer and the distributed one built by `distributed.optimizer.build_optimizer`; the
ideal share is replicated / (DP × CP). Time: the median over steps of the gradient synchronisation
(`finalize_model_grads`, not overlapped: all-reduce, or reduce to the owner) plus the optimizer step
(the distributed one includes its parameter broadcasts), on random gradients that differ per rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _cli import table

from megatron_sp.testing import LocalWorld


def _measure(tp, cp, hidden, layers, steps):
    from types import SimpleNamespace

    import torch

    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.distributed.grad_sync import finalize_model_grads
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.models.gpt import GPTModel

    torch.set_num_threads(1)
    ps = parallel_state.initialize_model_parallel(tp, cp)
    cfg = GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=8,
        vocab_size=4096,
        seq_length=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
    )
    out = {}
    for distributed in (False, True):
        model = GPTModel(cfg)
        args = SimpleNamespace(
            weight_decay=0.1,
            lr=1e-3,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            use_distributed_optimizer=distributed,
        )
        opt = build_optimizer(model, args, "cpu", ps)
        partition = getattr(opt, "partition", None)
        g = torch.Generator().manual_seed(torch.distributed.get_rank())
        times = []
        for _ in range(steps):
            for p in model.parameters():
                p.main_grad.copy_(torch.randn(p.shape, generator=g))  # the gradient buffers' views
            torch.distributed.barrier()
            start = time.perf_counter()
            finalize_model_grads(model, ps, opt.grad_buffers, None, partition)
            opt.prepare_grads()
            opt.step()
            times.append(time.perf_counter() - start)
        state = sum(
            t.numel() * t.element_size() for st in opt.optim.state.values() for k, t in st.items() if k != "step"
        )
        grads = opt.grad_buffers.nbytes()
        out[distributed] = (state, statistics.median(times) * 1e3, grads)
    out["params"] = sum(p.numel() for p in model.parameters())
    out["replicas"] = ps.replicas
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with LocalWorld(4) as world:
        for tp, cp in [(1, 1), (2, 1), (1, 2)]:
            ranks = world.run(_measure, tp, cp, args.hidden_size, args.num_layers, args.steps)
            plain = ranks[0][False][0]
            shares = [r[True][0] for r in ranks]
            n = ranks[0]["replicas"]
            rows.append(
                [
                    f"TP {tp} CP {cp} DP {4 // (tp * cp)}",
                    n,
                    f"{ranks[0]['params'] / 1e6:.2f}M",
                    f"{plain / 1e6:.2f}",
                    f"{max(shares) / 1e6:.2f}",
                    f"{min(shares) / 1e6:.2f}",
                    f"{max(shares) / (plain / n):.3f}",
                    f"{ranks[0][False][2] / 1e6:.2f}",
                    f"{max(r[True][2] for r in ranks) / 1e6:.2f}",
                    f"{statistics.median(r[False][1] for r in ranks):.1f}",
                    f"{statistics.median(r[True][1] for r in ranks):.1f}",
                ]
            )
    print(
        f"AdamW moments and gradients per rank after a step, hidden {args.hidden_size}, {args.num_layers} "
        f"layers, world 4 (gloo, CPU); time: gradient sync + optimizer step"
    )
    print(
        table(
            [
                "layout",
                "replicas",
                "params/rank",
                "moments repl. MB",
                "dist. max MB",
                "min MB",
                "max / ideal",
                "grads repl. MB",
                "dist. max MB",
                "ms repl.",
                "ms dist.",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
