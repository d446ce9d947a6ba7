"""What the training program, the optimizers, FSDP2, the checkpoints and the parity harness ask of a
model: one `typing.Protocol`, so they call these members instead of probing for them.

    model                               built by                        holds
    GPTModel (models/gpt.py)            GPTModel(cfg, ps)               the whole model (one stage)
    PipelineGPT                         PipelineGPT(cfg, layout, ps)    this rank's pipeline stages; also a
      (pipeline_parallel/model.py)                                      pipeline_parallel.model.PipelinedModel

Both are torch.nn.Modules (parameters, named_parameters, train / eval, state_dict), whose parameter
names are ReferenceGPT's whatever they hold.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable


@runtime_checkable
class TrainableModel(Protocol):
    """A model as the training program sees it (see the module docstring)."""

    cfg: object  # the GPTConfig it was built from
    ps: object  # the ParallelState whose groups it uses
    partial_grads: object  # tensor_parallel.partial_grads.PartialGrads: the sums a backward leaves pending
    stages: tuple  # models.language_model.Stage: the shares of the model built here

    def full_state_dict(self) -> dict:
        """Collective: the whole model's unsharded parameters, ReferenceGPT keys and shapes."""
        ...

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Loads a ReferenceGPT-shaped state dict, keeping what this rank holds."""
        ...

    def full_grad_dict(self) -> dict:
        """Collective: the whole model's unsharded gradients (every pending sum done first)."""
        ...

    def finalize_embedding_grads(self, grad: Optional[Callable] = None) -> None:
        """Sums the tied word embedding's gradient (`grad(param)`: the tensor to sum, default `.grad` or
        `main_grad`) over the ranks holding a copy of it, before the optimizer step; nothing where one
        rank holds both ends."""
        ...
