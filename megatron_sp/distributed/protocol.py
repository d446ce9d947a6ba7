"""What the training loop, the logs and the checkpoints ask of a run's optimizer: one `typing.Protocol`
that both optimizers implement (and subclass, to share its torch-facing members).

    optimizer                       built by                       gradients live in
    MixedPrecisionOptimizer         optimizer.build_optimizer      gradient buffers (`param.main_grad`),
      (replicated, or ZeRO-1 with                                  reduced by grad_sync
      --use-distributed-optimizer)
    FSDPOptimizer (ZeRO-3)          fsdp.build_fsdp_optimizer      FSDP2's sharded `.grad` (DTensors)

Per step the loop calls zero_grad(), runs the backward passes, then finalize_grads() (the reductions
left after the backward), prepare_grads() (the fp32 tensors to unscale and clip, each with `.grad`),
and step().
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from megatron_sp.models.trainable import TrainableModel
from megatron_sp.parallel_state import ParallelState


@runtime_checkable
class TrainingOptimizer(Protocol):
    """A run's optimizer as the training program sees it (see the module docstring)."""

    optim: object  # the torch optimizer holding this rank's AdamW state (checkpoints save it)
    grad_buffers: Optional[object]  # the gradient buffers the backward accumulates into; None: FSDP2's own
    partition: Optional[object]  # who holds which gradients, as the norms read it; None: every rank all

    @property
    def param_groups(self) -> list:
        """The torch optimizer's parameter groups (the LR schedule sets their "lr")."""
        return self.optim.param_groups

    @property
    def state(self) -> dict:
        return self.optim.state

    def main_params(self) -> dict:
        """{parameter name: fp32 weight this rank steps}: what a checkpoint saves as the model."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Before the first micro-batch of a step."""
        ...

    def finalize_grads(self, model: TrainableModel, ps: ParallelState, overlapped=None) -> None:
        """Everything between the last backward and clipping: the replica reductions (`overlapped`: the
        grad_sync.OverlappedGradSync that started them during the backward), the partial sums over TP,
        a pipeline's tied-embedding sum."""
        ...

    def prepare_grads(self) -> list:
        """The fp32 tensors this rank steps, each with its reduced gradient as `.grad` (unscale and
        clip those in place)."""
        ...

    def step(self) -> None: ...

    def cast_fp8_weights(self) -> None:
        """--fp8-param-gather: the FP8 weights cast from the main weights anew (at the start, after a
        load); nothing otherwise (distributed/fp8_param_gather.py)."""
        ...

    def params_norm(self, model, ps: ParallelState) -> float:
        """L2 norm of the full (serial) parameters, each counted once (--log-params-norm)."""
        ...

    def zero_grads_count(self, model, ps: ParallelState) -> int:
        """Zero elements of the full (serial) reduced gradient (--log-num-zeros-in-grad)."""
        ...
