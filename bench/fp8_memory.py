"""FP8's memory (issue 34): bytes per parameter and the activation bytes a layer keeps for its backward,
--bf16 against --bf16 with FP8 (each recipe), in one process (TP 1; the shares per rank scale as
bench/precision_memory.py shows).

    python bench/fp8_memory.py                 # hidden 512, 2 layers, 8 x 256 tokens
    python bench/fp8_memory.py --hidden-size 1024

bytes/param: after one real step (training/loop.py train_step), the tensor bytes the run holds per
parameter: weights, fp32 gradient buffers, fp32 main weights, AdamW moments, and the FP8 scaling state
(delayed: the amax histories and scales, per linear). activations: the bytes of every tensor autograd
saves for the backward during one forward (torch.autograd.graph.saved_tensors_hooks), parameters
left out, per token and layer (the output layer's logits included). FP8 GEMMs cast their operands
per GEMM and keep only the layer's dtype, so neither figure moves (the FP8 copies live for one GEMM).
gather B/param: what the distributed optimizer's owners broadcast (FSDP2: all-gather) per parameter and
step, bf16 (2) or with --fp8-param-gather (tensorwise, delayed: 1 byte per FP8 linear's weight element,
2 for the rest; distributed/fp8_param_gather.py, whose buffers tests/test_fp8_param_gather.py checks).
"""

from __future__ import annotations

import argparse

from _cli import table

RECIPES = (None, "tensorwise", "delayed", "rowwise", "mxfp8")


def _config(hidden, layers, seq, recipe):
    from megatron_sp.config import GPTConfig

    fp8 = {} if recipe is None else {"fp8": "hybrid", "fp8_recipe": recipe, "fp8_amax_history_len": 1024}
    return GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=8,
        vocab_size=4096,
        seq_length=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype="bf16",
        **fp8,
    )


def measure(hidden, layers, seq, batch, recipe) -> dict:
    import torch
    from precision_memory import _hyper

    from megatron_sp import parallel_state
    from megatron_sp.distributed.fp8_param_gather import fp8_weights
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.training.loop import train_step

    ps = parallel_state.initialize_model_parallel(1)
    model = GPTModel(_config(hidden, layers, seq, recipe))
    opt = build_optimizer(model, _hyper(False, False), "cpu", ps)
    tokens = torch.randint(0, 4096, (batch, seq), generator=torch.Generator().manual_seed(0))
    step = {"tokens": tokens, "labels": tokens.roll(-1, 1), "sample_ids": torch.arange(batch)}
    train_step(model, opt, iter([step]), 1, ps, device="cpu", clip_grad=1.0, iteration=1)
    n = sum(p.numel() for p in model.parameters())
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    scalings = [m.fp8.delayed for m in model.modules() if getattr(getattr(m, "fp8", None), "delayed", None)]
    parts = dict(
        weights=nbytes(model.parameters()),
        grads=opt.grad_buffers.nbytes(),
        main=nbytes(main for p, main in opt.pairs if main is not p),
        moments=nbytes(t for st in opt.optim.state.values() for k, t in st.items() if k != "step"),
        fp8_state=nbytes(t for s in scalings for t in (s.amax_history, s.scale)),
    )
    saved, params = [], {p.data_ptr() for p in model.parameters()}

    def pack(t):
        if t.data_ptr() not in params:  # (a GEMM's weight is saved too: not an activation)
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, tokens.roll(-1, 1), sample_ids=torch.arange(batch))
    in_fp8 = sum(w.numel() for w, _ in fp8_weights(model)) if recipe in ("tensorwise", "delayed") else 0
    return {
        **{k: v / n for k, v in parts.items()},
        "activations": sum(saved) / (batch * seq * layers),
        "gather": (in_fp8 + 2 * (n - in_fp8)) / n,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    a = p.parse_args()
    rows = []
    for recipe in RECIPES:
        m = measure(a.hidden_size, a.num_layers, a.seq_length, a.micro_batch_size, recipe)
        bpp = sum(m[k] for k in ("weights", "grads", "main", "moments", "fp8_state"))
        name = "bf16" if recipe is None else f"bf16 + fp8 {recipe}"
        cells = [f"{m[k]:.3f}" for k in ("weights", "grads", "main", "moments", "fp8_state")]
        rows.append([name, *cells, f"{bpp:.3f}", f"{m['activations']:.0f}", f"{m['gather']:.3f}"])
    print(
        f"bytes per parameter (TP 1, hidden {a.hidden_size}, {a.num_layers} layers) and activation bytes saved "
        f"for the backward per token per layer ({a.micro_batch_size} x {a.seq_length} tokens)"
    )
    heads = ["run", "weights", "grads", "main", "moments", "fp8 state", "bytes/param", "act. B/token/layer"]
    heads.append("gather B/param")
    print(table(heads, rows))


if __name__ == "__main__":
    main()
