"""Training-step time and memory of GPTModel on this machine: forward + backward + grad sync + AdamW
(the training program's optimizer: fp32 main weights and gradient buffers).

    python bench/model_step.py                          # TP=1 in this process, and TP=2+SP on 2 gloo ranks
    python bench/model_step.py --model llama --tp-sizes 1
    python bench/model_step.py --bf16                    # bf16 parameters and activations (Megatron's --bf16)
    python bench/model_step.py --device cuda --bf16 --num-layers 24 --hidden-size 2048 ...
    python bench/model_step.py --tp-sizes 1 --cp-sizes 2 --cp-comm-type p2p --dropout 0   # ring attention
    python bench/model_step.py --tp-sizes 1 --cp-sizes 2 --cp-comm-type a2a --documents 4 # Ulysses, documents
    python bench/model_step.py --torch-compile                                            # per-layer compile

Layouts: each TP size (TP+SP, CP 1), then each CP size > 1 (TP 1, --cp-comm-type); --documents N
cuts every sample into N equal documents (Megatron's block-diagonal mask, as --reset-attention-mask
gives). Per configuration: the median step time over --steps timed steps (after --warmup), tokens/s per
rank group, and the bytes autograd keeps for the backward (activations saved by one forward,
parameters excluded: the same counter as bench/activation_memory.py) on rank 0, and the first step's
seconds (with --torch-compile: the compilation). The figures are printed as a table; no pass/fail criterion.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _cli import add_shape_args, table

from megatron_sp.testing import LocalWorld


def _config(a, tp, cp=1):
    from megatron_sp.config import GPTConfig

    kw = dict(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        vocab_size=a.vocab_size,
        seq_length=a.seq_length,
        ffn_hidden_size=a.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        context_parallel_size=cp,
        cp_comm_type=a.cp_comm_type,
        tp_comm_overlap=tp > 1 and a.tp_comm_overlap,
        hidden_dropout=a.dropout,
        attention_dropout=a.dropout,
        use_fused_kernels=not a.no_fused_kernels,
        params_dtype="bf16" if a.bf16 else "fp32",
    )
    if a.model != "gpt2":
        kw["model"] = a.model
    return GPTConfig(**kw)


def _saved_bytes(model, tokens, labels):
    from activation_memory import SavedTensorCounter

    with SavedTensorCounter(model) as counter:
        loss = model(tokens, labels)
    del loss
    return sum(r["nbytes"] for r in counter.records.values())


def _document_mask(a):
    """[b, 1, s, s] bool, True = masked: --documents equal documents per sample, or None."""
    import torch

    if not a.documents:
        return None
    doc = torch.arange(a.seq_length) * a.documents // a.seq_length  # [s] document of each token
    mask = doc.view(-1, 1) != doc.view(1, -1)
    return mask.view(1, 1, a.seq_length, a.seq_length).expand(a.micro_batch_size, 1, -1, -1).to(a.device)


def measure(a, tp, cp=1):
    """Runs on every rank of a TP x CP group (or in-process for one rank); returns rank 0's figures."""
    from types import SimpleNamespace

    import torch

    from megatron_sp import parallel_state
    from megatron_sp.distributed.grad_sync import finalize_model_grads
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.models.gpt import GPTModel

    torch.manual_seed(0)
    ps = parallel_state.initialize_model_parallel(tp, cp)
    model = GPTModel(_config(a, tp, cp), ps, device=a.device)
    compile_seconds = _compile(a, model)
    hyper = dict(lr=1e-4, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    opt = build_optimizer(model, SimpleNamespace(**hyper), a.device, ps)  # fp32 main weights under --bf16
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length), generator=g).to(a.device)
    labels = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length), generator=g).to(a.device)
    mask = _document_mask(a)
    times, first = [], None
    for step in range(a.warmup + a.steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(tokens, labels, attention_mask=mask)
        loss.backward()
        finalize_model_grads(model, ps, opt.grad_buffers)
        opt.prepare_grads()
        opt.step()
        if a.device == "cuda":
            torch.cuda.synchronize()
        if step == 0:  # with --torch-compile: the compilation of the forward and the backward
            first = time.perf_counter() - start
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    saved = _saved_bytes(model, tokens, labels)
    ms = 1000 * statistics.median(times)
    return {
        "tp": tp,
        "first_s": first + compile_seconds,
        "ms": ms,
        "min_ms": 1000 * min(times),
        "tokens_per_s": a.micro_batch_size * a.seq_length / (ms / 1000),
        "saved_bytes": saved,
    }


def _compile(a, model) -> float:
    """--torch-compile: each layer compiled (megatron_sp/models/compile.py); returns 0 without it.
    The compilation itself happens in the first (warm-up) steps."""
    if not a.torch_compile:
        return 0.0
    from megatron_sp.models.compile import compile_layers

    start = time.perf_counter()
    compile_layers(model)
    return time.perf_counter() - start


def _layouts(a):
    """(tp, cp) pairs: every --tp-sizes entry at CP 1, then every --cp-sizes entry > 1 at TP 1."""
    tps = [(int(t), 1) for t in a.tp_sizes.split(",") if t]
    return tps + [(1, int(c)) for c in a.cp_sizes.split(",") if c and int(c) > 1]


def _label(a, tp, cp):
    if cp > 1:
        return f"CP={cp} ({'ring' if a.cp_comm_type == 'p2p' else 'Ulysses'})"
    return f"TP={tp}{'+SP' if tp > 1 else ''}{' overlapped' if tp > 1 and a.tp_comm_overlap else ''}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.set_defaults(seq_length=256, micro_batch_size=4, hidden_size=256, num_attention_heads=8, vocab_size=8192)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--model", default="gpt2")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--cp-sizes", default="", help="context-parallel sizes, each at TP 1")
    p.add_argument("--cp-comm-type", choices=["p2p", "a2a"], default="p2p")
    p.add_argument("--documents", type=int, default=0, help="documents per sample (a block-diagonal mask)")
    p.add_argument("--torch-compile", action="store_true", help="compile each transformer layer")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--no-fused-kernels", action="store_true")
    p.add_argument("--tp-comm-overlap", action="store_true", help="TP > 1: overlap SP's collectives with the GEMMs")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    for tp, cp in _layouts(a):
        if tp * cp == 1:
            res = measure(a, 1)
        else:
            with LocalWorld(tp * cp) as world:
                res = world.run(measure, a, tp, cp)[0]
        rows.append(
            [
                _label(a, tp, cp),
                f"{res['ms']:.1f}",
                f"{res['min_ms']:.1f}",
                f"{res['tokens_per_s']:.0f}",
                f"{res['saved_bytes'] / 2**20:.2f}",
                f"{res['first_s']:.1f}",
            ]
        )
    print(
        f"{a.model}: L={a.num_layers} h={a.hidden_size} n={a.num_attention_heads} s={a.seq_length} "
        f"b={a.micro_batch_size} V={a.vocab_size} dropout={a.dropout} documents={a.documents or 1} "
        f"{'bf16' if a.bf16 else 'fp32'} fused={not a.no_fused_kernels} compiled={a.torch_compile} "
        f"device={a.device}, 1 thread per rank"
    )
    print(table(["layout", "median ms/step", "min ms", "tokens/s", "saved MiB (rank 0)", "first step s"], rows))


if __name__ == "__main__":
    main()
