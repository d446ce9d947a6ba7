"""--torch-compile (megatron_sp/models/compile.py): a transformer layer is one graph for
torch._dynamo.explain (no graph break) in every layout — the fused ops as custom ops, TP+SP's
functional collectives, Ulysses' all-to-all, ring attention as one custom op, documents, dropout —
and models whose layers are compiled keep the parity contract of tests/test_parity.py: the serial
model with inductor, TP=2+SP through dynamo and AOTAutograd (aot_eager: the same graphs, less
compile time)."""

import pytest
import torch

from megatron_sp.testing import LocalWorld
from megatron_sp.testing.parity import rel
from megatron_sp.testing.tiny import check_parity, pipeline_batch, pipeline_config, tiny_batch, tiny_config

SEQ, BATCH = 32, 2
pytestmark = pytest.mark.extension  # --torch-compile runs with the fused ops (compile.py says why)


@pytest.fixture(scope="module")
def pool():
    p = LocalWorld(2)
    yield p
    p.close()


def _documents_mask():
    doc = (torch.arange(SEQ) >= 11).long() + (torch.arange(SEQ) >= 20).long()
    return (doc.view(-1, 1) != doc.view(1, -1)).view(1, 1, SEQ, SEQ).expand(BATCH, 1, SEQ, SEQ)


def _explain_layer(tp, cp, comm, family, dropout, documents):
    """(graphs, graph breaks, reasons) of torch._dynamo.explain over the model's first layer."""
    import torch._dynamo as dynamo

    from megatron_sp import parallel_state
    from megatron_sp.models.gpt import GPTModel

    ps = parallel_state.initialize_model_parallel(tp, cp)
    cfg = tiny_config(tp, tp > 1, dropout, True, family, cp, comm)
    model = GPTModel(cfg, ps)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mask = _documents_mask() if documents else None
    batch = dict(labels=tokens, loss_mask=None, position_ids=None, sample_ids=None, training=True)
    seq = model.builder.sequence_context(cfg, tokens, attention_mask=mask, **batch)
    explained = dynamo.explain(model.layers[0])(model.embedding(seq.tokens, seq), seq)
    return explained.graph_count, explained.graph_break_count, [str(b.reason)[:300] for b in explained.break_reasons]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_serial_layer_is_one_graph(family):
    """TP 1 (the speed configuration): fused LayerNorm/RMSNorm, bias-dropout-add, blockwise attention."""
    graphs, breaks, reasons = _explain_layer(1, 1, "p2p", family, 0.1, False)
    assert (graphs, breaks) == (1, 0), reasons


@pytest.mark.parametrize(
    "tp,cp,comm,family,dropout,documents",
    [
        (2, 1, "p2p", "llama", 0.1, False),  # TP+SP: all-gathers, reduce-scatters, GQA copies
        (1, 2, "p2p", "llama", 0.1, True),  # ring attention (our kernel: dropout), documents
        (1, 2, "a2a", "gpt2", 0.0, True),  # Ulysses, SDPA with the document mask
    ],
)
def test_parallel_layer_is_one_graph(pool, tp, cp, comm, family, dropout, documents):
    for graphs, breaks, reasons in pool.run(_explain_layer, tp, cp, comm, family, dropout, documents):
        assert (graphs, breaks) == (1, 0), reasons


def test_compiled_serial_model_keeps_parity():
    """GPTModel at TP 1 with inductor-compiled layers, dropout on: loss and every gradient of
    ReferenceGPT over 2 AdamW steps (the parameter names are unchanged by the compilation)."""
    from megatron_sp.models.compile import compile_layers
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.models.reference import ReferenceGPT

    cfg = tiny_config(dropout=0.1, fused=True)
    ref = ReferenceGPT(cfg)
    model = compile_layers(GPTModel(cfg))
    model.load_full_state_dict(ref.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    for step in range(2):
        tokens, labels, ids = tiny_batch(step)
        losses = []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            loss = m(tokens, labels, sample_ids=ids)
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0]), losses
        grads = model.full_grad_dict()
        for name, p in ref.named_parameters():
            assert rel(grads[name], p.grad) < 1e-5, name
        for opt in opts:
            opt.step()


def test_compiled_tensor_parallel_layers_keep_parity(pool):
    """TP 2 + SP, Llama with GQA, dropout on, fused ops, layers through dynamo + AOTAutograd: the
    loss, every gradient and 3 AdamW steps of the serial model."""
    check_parity(pool, 2, True, 0.1, fused=True, family="llama", compile_options={"backend": "aot_eager"})


def _compiled_pipeline(vp):
    """PP2 (1F1B, or interleaved with 2 chunks per rank), Llama with GQA, dropout on, fused ops: the micro-
    batch losses and gathered gradients of the pipeline whose layers compile_layers compiled (dynamo +
    AOTAutograd), against the same pipeline eager; and against the serial model."""
    import dataclasses

    from megatron_sp import parallel_state
    from megatron_sp.models.compile import compile_layers
    from megatron_sp.models.reference import ReferenceGPT
    from megatron_sp.pipeline_parallel.layout import PipelineLayout
    from megatron_sp.pipeline_parallel.model import PipelineGPT

    ps = parallel_state.initialize_model_parallel(1, 1, pipeline_model_parallel_size=2)
    cfg = dataclasses.replace(pipeline_config("llama", 1, 1, False), use_fused_kernels=True)
    tokens, labels = pipeline_batch(4)
    reference = ReferenceGPT(cfg).train()
    reference(tokens, labels).backward()
    runs = []
    for compiled in (False, True):
        pipe = PipelineGPT(cfg, PipelineLayout(2, vp), ps).train()
        if compiled:
            compile_layers(pipe, backend="aot_eager")
        runs.append((pipe.step(tokens, labels, num_microbatches=4).tolist(), pipe.full_grad_dict()))
    (eager, eager_grads), (losses, grads) = runs
    worst = max(rel(grads[k], p.grad) for k, p in reference.named_parameters())
    return losses == eager and all(torch.equal(grads[k], eager_grads[k]) for k in grads), worst


@pytest.mark.parametrize("vp", [1, 2], ids=["1f1b", "interleaved"])
def test_compiled_pipeline_stages_keep_parity(pool, vp):
    """--torch-compile under pipeline parallelism: the schedule runs the compiled layers, bit for bit the
    eager pipeline's losses and gradients (aot_eager), the serial model's within 1e-5. (The zero-bubble
    schedules' split backward cannot see through compiled graphs: refused, tests/test_megatron_flag_sets.py.)"""
    for same, worst in pool.run(_compiled_pipeline, vp):
        assert same and worst < 1e-5
