"""The test suite's tiny models, built in one place: the GPTConfig of the parity tests (tiny_fields,
tiny_config), their batches (tiny_batch), the pipeline tests' model (pipeline_config, pipeline_batch),
check_parity (the harness of parity.py with the suite's extra assertions) and a checkpoint read back as
the serial model (reference_from_checkpoint). tests/ import these instead of each other's helpers.
"""

from __future__ import annotations

import functools

import torch

from megatron_sp.testing.layouts import Layout
from megatron_sp.testing.parity import TOLERANCES, compare, make_batches, run_layout, run_serial

VOCAB, SEQ, BATCH, STEPS = 97, 32, 2, 3  # 97: not divisible by any TP size
PIPELINE_VOCAB, PIPELINE_SEQ = 61, 8

FAMILIES = {
    "gpt2": {},
    "llama": {"model": "llama", "num_query_groups": 2},
    # Llama 3.1's RoPE scaling, original context < SEQ: every frequency band in use
    "llama-rope-scaled": {
        "model": "llama",
        "num_query_groups": 2,
        "rope_scaling": True,
        "rope_scaling_original_max_position_embeddings": 16,
    },
}


def tiny_fields(dropout=0.0, fused=False, family="gpt2", extra=None) -> dict:
    """The GPTConfig fields of a parity case besides its layout (family: a FAMILIES key, a registered model
    name or a "module:SPEC" path; extra: more fields)."""
    return dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_length=SEQ,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        use_fused_kernels=fused,
        **FAMILIES.get(family, {"model": family}),
        **(extra or {}),
    )


def tiny_config(tp=1, sp=False, dropout=0.0, fused=False, family="gpt2", cp=1, comm="p2p", extra=None):
    from megatron_sp.config import GPTConfig

    layout = Layout(tp=tp, sp=sp, cp=cp, cp_comm=comm)
    return GPTConfig(**tiny_fields(dropout, fused, family, extra), **layout.config_fields())


BATCHES = make_batches(VOCAB, SEQ, BATCH, STEPS)  # step i: seed 100 + i, sample ids new every step


def tiny_batch(step):
    """(tokens, labels, sample ids) of step `step`: the parity batches, the same on every rank."""
    b = BATCHES[step] if step < STEPS else make_batches(VOCAB, SEQ, BATCH, step + 1)[step]
    return b.tokens, b.labels, b.sample_ids


def pipeline_config(model, tp, cp, sp, layers=4):
    """The pipeline tests' model: hidden 16, `layers` layers, sequences of PIPELINE_SEQ, dropout on
    (GPTConfig's 0.1 / 0.1)."""
    from megatron_sp.config import GPTConfig

    extra = dict(num_query_groups=2, ffn_hidden_size=32) if model == "llama" else {}
    return GPTConfig(
        model=model,
        num_layers=layers,
        hidden_size=16,
        num_attention_heads=4,
        vocab_size=PIPELINE_VOCAB,
        seq_length=PIPELINE_SEQ,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=sp,
        **extra,
    )


def pipeline_batch(samples, seed=0):
    """[samples, PIPELINE_SEQ] tokens and labels."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, PIPELINE_VOCAB, (samples, PIPELINE_SEQ), generator=g)
    labels = torch.randint(0, PIPELINE_VOCAB, (samples, PIPELINE_SEQ), generator=g)
    return tokens, labels


def _copies(model, ps):
    """Local pieces of segments held in copies (GQA key/value heads), by (name, segment, part)."""
    from megatron_sp.tensor_parallel.sharding import split_local

    out = {}
    for name, p in model.named_parameters():
        if p.shard_spec.segments:
            for i, (shard, view) in enumerate(split_local(p.detach(), p.shard_spec, ps.tp_rank, ps.tp_size)):
                if shard.copies > 1:
                    out[(name, i, shard.offset)] = view.clone()
    return out


def _replicas(model, ps):
    """check_parity's probe: parameters replicated over TP (to be bit-identical) and the copies."""
    replicated = {n: p.detach().clone() for n, p in model.named_parameters() if p.shard_spec.dim is None}
    return {"replicated": replicated, "copies": _copies(model, ps)}


def _compile(model, options):  # --torch-compile
    from megatron_sp.models.compile import compile_layers

    compile_layers(model, **options)


def check_parity(
    pool,
    tp,
    sp,
    dropout,
    fused,
    family="gpt2",
    cp=1,
    comm="p2p",
    extra=None,
    shared=None,
    final_rtol=TOLERANCES["params"],
    compile_options=None,
):
    """The parallel model (extra: more GPTConfig fields, e.g. recomputation; compile_options: its layers
    compiled with them) against the plain reference (shared: fields of both, the model variant), through
    parity.py's harness in the world `pool`. final_rtol: the weights after the AdamW steps (the losses
    and first gradients are held to 1e-5; its default and why: parity.TOLERANCES). Besides the harness's
    differences: every rank's initial shard is the reference's slice, parameters replicated across the
    TP group are bit-identical, and so are the copies of a key/value head."""
    oracle = run_serial(tiny_fields(dropout, False, family, shared), BATCHES)
    layout = Layout(tp=tp, sp=sp and tp > 1, cp=cp, cp_comm=comm)
    prepare = None if compile_options is None else functools.partial(_compile, options=compile_options)
    fields = tiny_fields(dropout, fused, family, {**(shared or {}), **(extra or {})})
    runs = pool.run(run_layout, fields, layout, BATCHES, prepare=prepare, probe=_replicas)
    runs = [r for r in runs if r is not None]
    assert len(runs) == tp
    for run in runs:
        row = compare(oracle, run, layout)
        assert not row.missing and row.init is None, row  # init on the full tensor, then sliced
        assert row.failures({**TOLERANCES, "params": final_rtol}) == [], row
        for k in oracle.grads0:
            if k.endswith("attn.k_norm.bias"):  # shifts every key alike: softmax-invariant, no gradient
                assert run.grads0[k].abs().max() < 1e-6 and oracle.grads0[k].abs().max() < 1e-6, k
    for k, value in runs[0].extra["replicated"].items():  # bit-identical across the TP group
        for run in runs[1:]:
            assert torch.equal(run.extra["replicated"][k], value), k
    copies = {}
    for run in runs:  # copies of a key/value head: identical
        for key, value in run.extra["copies"].items():
            assert torch.equal(copies.setdefault(key, value), value), key
    if family == "llama" and tp == 4:
        assert copies, "GQA with 2 key/value heads at TP=4 must hold them in copies"


def reference_from_checkpoint(save, **overrides):
    """The serial model of a saved checkpoint (its config, dropout off, the reference ops), in eval mode."""
    from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state
    from megatron_sp.config import config_from_dict
    from megatron_sp.models.reference import ReferenceGPT

    state, meta = read_full_state(checkpoint_path(save))
    cfg = config_from_dict(
        meta["config"], hidden_dropout=0.0, attention_dropout=0.0, use_fused_kernels=False, **overrides
    )
    model = ReferenceGPT(cfg, initialise=False)
    model.load_state_dict(state)
    return model.eval()
