"""FP8 GEMMs of the column/row-parallel linears, on torchao's casting primitives.

A linear layer built with FP8 holds one `Fp8Gemms`, which runs the three GEMMs of _ParallelLinear
(layers.py) with both operands cast to FP8 (e4m3 forward; the output gradient e5m2 under `hybrid`):

    GEMM    product             contraction   sharded over (column layer / row layer)
    fprop   y  = x @ w.T        K  (in)       -  / TP
    dgrad   dx = dy @ w         N  (out)      TP / -
    wgrad   dw = dy.T @ x       M  (tokens)   CP / CP

Scales are those of the whole logical tensor, never of this rank's shard: every amax is all-reduced
(MAX) over the groups that split what it is taken over, so each element is cast exactly as at TP=1
and FP8 stays layout-invariant up to the GEMMs' fp32 summation order. Recipes (Megatron's names):

    recipe       scale                                         amax reduced over
    tensorwise   one per tensor, from its own amax (current)   TP and CP (replicas give the same)
    delayed      one per tensor, from the amax history of      TP, CP and DP (Megatron's amax
                 earlier steps (max or most_recent, margin)    reduction group): one history per stage
    rowwise      one per row along the contraction (torchao)   the groups that split the contraction
    mxfp8        one per 32 elements of the contraction, e8m0  none: a block never crosses a shard

On CPU the FP8 products are torchao's emulation (the FP8 values, multiplied in fp32: CPU's
`torch._scaled_mm` is thousands of times slower); on CUDA `torch._scaled_mm`. mxfp8 is emulated
everywhere (MXTensor cast and back, then the layer's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

MX_BLOCK = 32  # elements per MX scale (the OCP MX format's block)
INPUT, WEIGHT, GRAD = 0, 1, 2  # rows of a delayed-scaling history


@dataclass(frozen=True)
class Fp8Recipe:
    """Megatron's FP8 settings (--fp8-format, --fp8-recipe, --fp8-margin, --fp8-amax-history-len,
    --fp8-amax-compute-algo); the last three shape delayed scaling only, as in Transformer Engine."""

    format: str = "hybrid"  # e4m3: every FP8 tensor e4m3; hybrid: output gradients e5m2
    recipe: str = "delayed"
    margin: int = 0  # delayed: scale = fp8_max / amax / 2**margin
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"  # or "max" over the history

    def dtype(self, role: int) -> torch.dtype:
        return torch.float8_e5m2 if role == GRAD and self.format == "hybrid" else torch.float8_e4m3fn


@dataclass(frozen=True)
class AmaxGroups:
    """The process groups a layer's amaxes are reduced over (None or size 1: not split)."""

    tp: Optional[object] = None
    cp: Optional[object] = None
    dp: Optional[object] = None  # delayed scaling only


def _live(groups) -> list:
    return [g for g in groups if g is not None and dist.get_world_size(g) > 1]


@torch.no_grad()
def reduce_amax(amaxes: list, groups) -> list:
    """Each amax all-reduced (MAX) over `groups`, all of them in one collective per group."""
    live = _live(groups)
    if not live:
        return amaxes
    flat = torch.cat([a.reshape(-1).float() for a in amaxes])
    for group in live:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    return [part.view(a.shape) for part, a in zip(flat.split([a.numel() for a in amaxes]), amaxes)]


class DelayedScaling:
    """One layer's amax histories and scales (input, weight, output gradient): Transformer Engine's
    delayed scaling. A tensor is cast with its current scale; its amax (over the reduction group)
    then enters the history and the scale becomes fp8_max / amax / 2**margin, amax being the history's
    max or its most recent entry (the scale is kept while that amax is 0 or not finite; it starts at 1)."""

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self.amax_history = torch.zeros(recipe.amax_history_len, 3, device="cpu")  # [len, role], newest first
        self.scale = torch.ones(3, device="cpu")

    def current(self, role: int, device) -> torch.Tensor:
        self._to(device)
        return self.scale[role].clone()

    @torch.no_grad()
    def record(self, roles, amaxes) -> None:
        for role, amax in zip(roles, amaxes):
            self._to(amax.device)
            history = self.amax_history[:, role]
            history.copy_(torch.roll(history, 1))
            history[0] = amax.float()
            chosen = history.max() if self.recipe.amax_compute_algo == "max" else history[0]
            fp8_max = torch.finfo(self.recipe.dtype(role)).max
            new = fp8_max / chosen.double() / 2.0**self.recipe.margin
            ok = (chosen > 0) & torch.isfinite(chosen)
            self.scale[role] = torch.where(ok, new.float(), self.scale[role])

    def _to(self, device) -> None:
        if self.scale.device != torch.device(device):
            self.amax_history, self.scale = self.amax_history.to(device), self.scale.to(device)

    def state_dict(self) -> dict:
        return {"amax_history": self.amax_history.cpu().clone(), "scale": self.scale.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["amax_history"].shape) != tuple(self.amax_history.shape):
            raise ValueError(
                f"the checkpoint's FP8 amax history has {state['amax_history'].shape[0]} entries and "
                f"--fp8-amax-history-len is {self.amax_history.shape[0]}; resume with the checkpoint's length."
            )
        self.amax_history = state["amax_history"].to(self.scale.device).clone()
        self.scale = state["scale"].to(self.scale.device).clone()


class Fp8Gemms:
    """The FP8 fprop, dgrad and wgrad of one column (row=False) or row-parallel (row=True) linear.
    x [.., K], w [N, K], dy [.., N]; the leading dims of x and dy are the tokens M."""

    def __init__(self, recipe: Fp8Recipe, groups: AmaxGroups, *, row: bool):
        self.recipe, self.groups, self.row = recipe, groups, row
        self.delayed = DelayedScaling(recipe) if recipe.recipe == "delayed" else None
        self.weight_scale, self._weight_version = None, None  # --fp8-param-gather: hold_weight

    def hold_weight(self, w: torch.Tensor, scale: torch.Tensor) -> None:
        """--fp8-param-gather (distributed/fp8_param_gather.py): w holds FP8 values cast with `scale`,
        which the GEMMs cast it with (getting those values back) instead of its own amax's."""
        self.weight_scale, self._weight_version = scale, w._version

    def _held_scale(self, w: torch.Tensor) -> torch.Tensor:
        if w._version != self._weight_version:
            raise RuntimeError(
                "an FP8 weight changed after --fp8-param-gather cast it; write weights through the optimizer's "
                "main weights and call its cast_fp8_weights()."
            )
        return self.weight_scale

    def fprop(self, x: torch.Tensor, w: torch.Tensor, gather=None):
        """(y [.., N], what the backward needs). gather: x is this rank's sequence shard and gather(t)
        all-gathers dim 0 (SP). Under tensor scales the shard is cast first (its amax, reduced, is the
        tensor's) and gathered in FP8 (half of bf16's bytes), and the backward keeps that FP8 shard
        in place of x (saved["x8"], uint8): the same values as casting the gathered x."""
        if self.recipe.recipe in ("tensorwise", "delayed"):
            if self.weight_scale is None:
                sx, sw = self._tensor_scales([INPUT, WEIGHT], [x, w])
            else:  # (the weight's amax entered its history when it was cast)
                (sx,), sw = self._tensor_scales([INPUT], [x]), self._held_scale(w)
            x8 = to_fp8(x, sx, self.recipe.dtype(INPUT))
            total = x8 if gather is None else gather(x8.view(torch.uint8)).view(x8.dtype)
            saved = {"sx": sx, "sw": sw, "x8": x8.view(torch.uint8), "dtype": x.dtype}
            a8 = _wrap(total.reshape(-1, x.shape[-1]), sx, x.dtype, 0)
            y = torch.mm(a8, _cast(w.t(), sw, self.recipe.dtype(WEIGHT), 1))
            return y.view(*total.shape[:-1], w.shape[0]), saved
        total = x if gather is None else gather(x)
        x2 = total.reshape(-1, x.shape[-1])
        y = self._by_contraction(x2, w.t(), INPUT, WEIGHT, self._contraction_groups("fprop"))
        return y.view(*total.shape[:-1], w.shape[0]), {}

    def dgrad(self, dy: torch.Tensor, w: torch.Tensor, saved: dict) -> torch.Tensor:
        dy2 = dy.reshape(-1, dy.shape[-1])
        w = w.to(dy.dtype)
        if self.recipe.recipe in ("tensorwise", "delayed"):
            (saved["sg"],) = self._tensor_scales([GRAD], [dy2])
            dx = _scaled_mm(dy2, w, saved["sg"], saved["sw"], self.recipe.dtype(GRAD), self.recipe.dtype(WEIGHT))
        else:
            dx = self._by_contraction(dy2, w, GRAD, WEIGHT, self._contraction_groups("dgrad"))
        return dx.view(*dy.shape[:-1], w.shape[1])

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor, saved: dict) -> torch.Tensor:
        """x: the layer's whole input, or under tensor scales the FP8 bytes fprop kept, gathered."""
        dy2 = dy.reshape(-1, dy.shape[-1])
        if self.recipe.recipe in ("tensorwise", "delayed"):
            x8 = x.view(self.recipe.dtype(INPUT)).reshape(-1, x.shape[-1])
            g8 = _cast(dy2.t(), saved["sg"], self.recipe.dtype(GRAD), 0)
            return torch.mm(g8, _wrap(x8, saved["sx"], saved["dtype"], 1)).to(dy.dtype)
        x2 = x.reshape(-1, x.shape[-1]).to(dy.dtype)
        return self._by_contraction(dy2.t(), x2, GRAD, INPUT, self._contraction_groups("wgrad"))

    def _tensor_scales(self, roles, tensors) -> list:
        """One scale per tensor: current (its amax over the groups) or delayed (the history's)."""
        amaxes = [t.detach().abs().max() for t in tensors]
        if self.delayed is None:
            amaxes = reduce_amax(amaxes, (self.groups.tp, self.groups.cp))
            return [amax_to_scale(a, self.recipe.dtype(r)) for a, r in zip(amaxes, roles)]
        scales = [self.delayed.current(r, tensors[0].device) for r in roles]
        self.delayed.record(roles, reduce_amax(amaxes, (self.groups.tp, self.groups.cp, self.groups.dp)))
        return scales

    def _contraction_groups(self, gemm: str) -> tuple:
        """The groups that split a GEMM's contraction (see the module docstring's table)."""
        split = {"fprop": self.row, "dgrad": not self.row}.get(gemm)
        if gemm == "wgrad":
            return (self.groups.cp,)
        return (self.groups.tp,) if split else ()

    def _by_contraction(self, a, b, role_a, role_b, groups) -> torch.Tensor:
        """a [M, K] @ b [K, N] with scales along K: rowwise or mxfp8."""
        da, db = self.recipe.dtype(role_a), self.recipe.dtype(role_b)
        if self.recipe.recipe == "mxfp8":
            return _mx_cast(a, da) @ _mx_cast(b.t(), db).t()
        amax_a, amax_b = reduce_amax(
            [a.detach().abs().amax(1, keepdim=True), b.detach().abs().amax(0, keepdim=True)], groups
        )
        return _scaled_mm(a, b, amax_to_scale(amax_a, da), amax_to_scale(amax_b, db), da, db, axiswise=True)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from torchao.float8 import float8_utils

    return float8_utils.amax_to_scale(amax, dtype)


def _mm_config(device, emulate=None):
    """torchao's GEMM settings: torch._scaled_mm on CUDA (fast accumulation for the output GEMM, as
    torchao's Float8Linear), its emulation elsewhere unless emulate=False (tests run the CUDA path on CPU)."""
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    emulate = device.type != "cuda" if emulate is None else emulate
    return LinearMMConfig(*(ScaledMMConfig(emulate, not emulate and i == 0, False, True) for i in range(3)))


def _scaled_mm(a, b, scale_a, scale_b, dtype_a, dtype_b, axiswise: bool = False) -> torch.Tensor:
    """a [M, K] @ b [K, N], each cast to FP8 with its scale (a scalar, or [M, 1] and [1, N] rowwise):
    torchao's Float8TrainingTensor product (emulated off CUDA)."""
    return torch.mm(_cast(a, scale_a, dtype_a, 0, axiswise), _cast(b, scale_b, dtype_b, 1, axiswise))


def _cast(t, scale, dtype, operand: int, axiswise: bool = False):
    """t as torchao's Float8TrainingTensor, operand 0 (a; rowwise scales [M, 1]) or 1 (b; [1, N])."""
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

    role = (GemmInputRole.INPUT, GemmInputRole.WEIGHT)[operand]
    axis = (-1 if operand == 0 else 0) if axiswise else None
    return hp_tensor_and_scale_to_float8(t, scale, dtype, _mm_config(t.device), role, axis)


def to_fp8(t, scale, dtype) -> torch.Tensor:
    """t's FP8 values under a tensor scale, cast as torchao casts (the fp32 product, saturated)."""
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(t.to(torch.float32) * scale, dtype)


def _wrap(data, scale, orig_dtype, operand: int):
    """FP8 values cast already as the Float8TrainingTensor operand `operand` (0: a, 1: b) of a product."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    role = (GemmInputRole.INPUT, GemmInputRole.WEIGHT)[operand]
    return Float8TrainingTensor(data, scale, orig_dtype, _mm_config(data.device), role)


def _mx_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t [R, C] through MXFP8 along C (blocks of 32) and back to t's dtype."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    if t.shape[-1] % MX_BLOCK:
        raise ValueError(
            f"--fp8-recipe mxfp8 needs every GEMM's contraction on a rank to be a multiple of {MX_BLOCK}, "
            f"got {t.shape[-1]}; choose sizes (hidden, ffn, heads x kv-channels, tokens per rank) divisible by it."
        )
    hp = t.float() if t.dtype not in (torch.float32, torch.bfloat16) else t
    return MXTensor.to_mx(hp.contiguous(), dtype, MX_BLOCK).dequantize(t.dtype)
