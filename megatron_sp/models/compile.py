"""--torch-compile: every transformer layer compiled on its own (torch.compile per block, applied from
outside the model as torchtitan does; Megatron-LM has no such flag).

What stays whole in each layer's graph: the norms, projections and bias-dropout-adds, the fused ops
(megatron_sp._C custom ops, with their fake and autograd registrations), the tensor-parallel
collectives (traced as functional collectives) and the context-parallel ones (Ulysses' all-to-all;
ring attention as one custom op). tests/test_compile.py checks with torch._dynamo.explain that a layer
of each layout is one graph, and that a compiled model keeps the parity contract.

The embedding, the final norm and the loss stay eager: they run once per step, and the vocab-parallel
cross entropy has its own collectives.

The fused ops are required: compiled, the PyTorch reference of the Philox dropout (ops/philox.py) is
hundreds of integer ops per mask, minutes of inductor time per layer on CPU, and on torch 2.13 its
hidden dropout came out wrong at TP 2 (Llama; the loss NaN) where the fused op is right.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_sp.ops._extension import BUILT_DEVICES


def compile_problem(use_fused_kernels: bool, device: str, tp_comm_overlap: bool = False) -> Optional[str]:
    """Why the layers cannot be compiled on `device` (one sentence), or None."""
    if not use_fused_kernels:
        return "--torch-compile compiles the layers around the fused ops: drop --no-fused-kernels."
    if tp_comm_overlap:  # its isend/irecv ring would break every layer's graph at each step
        return "--torch-compile cannot trace --tp-comm-overlap's point-to-point ring: use one of the two."
    if device not in BUILT_DEVICES:
        return (
            f"--torch-compile needs megatron_sp._C built with {device} kernels (built for: "
            f"{', '.join(sorted(BUILT_DEVICES)) or 'nothing'}); build it with `pip install --no-build-isolation -e .`."
        )
    return None


def compile_layers(model, **options):
    """Compiles each of `model.layers` in place (nn.Module.compile: parameter names and state-dict keys
    do not change); options go to torch.compile. Returns the model. A pipeline's stages (PipelineGPT,
    the layers it holds) compile alike: the schedule calls the compiled layers."""
    cfg = model.cfg
    problem = compile_problem(cfg.use_fused_kernels, next(model.parameters()).device.type, cfg.tp_comm_overlap)
    if problem:
        raise ValueError(problem)
    layers = list(model.layers)
    _allow_one_graph_per_layer(2 * len(layers))
    for block in layers:
        block.compile(**options)
    return model


def _allow_one_graph_per_layer(graphs: int) -> None:
    """The layers share one forward, and each layer's id is a constant of its graph (it keys the
    dropout masks), so dynamo keeps one graph per layer and mode (train / eval) for that code: more
    than its default limit of 8, after which it would silently run the rest eagerly."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, graphs)
