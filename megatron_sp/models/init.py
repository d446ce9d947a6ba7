"""Deterministic initialisation, drawn shard by shard.

Every element of a parameter's full (serial) tensor is a pure function of (config seed, parameter
name, the element's index in the full tensor), as the dropout masks are (ops/philox.py): a rank draws
exactly the elements of its shard and never the whole tensor, so a model built at TP=4 starts
bit-identical to the one built at TP=1 (ReferenceGPT draws the same way: its shard is the whole),
whatever the order in which parameters are created.

The full tensor is read as *lines* along its split dimension (the ShardSpec's dim; dim 0 when it is
replicated): line i is full.select(dim, i), its elements in C order, and a rank holds whole lines.
Element j of line i of parameter `name`, for tag "normal" with std σ:

    key     = (crc32(name), crc32(name reversed))                   64 bits of the name
    counter = (j // 4, i, seed mod 2^32, INIT_DOMAIN)               INIT_DOMAIN: never a dropout counter
    w0..w3  = Philox4x32-10(key, counter)
    u1, u2  = (w0 + 1) / 2^32, w1 / 2^32  (lanes 0, 1);  (w2 + 1) / 2^32, w3 / 2^32  (lanes 2, 3)
    value   = σ · sqrt(-2 ln u1) · (cos 2π u2  for lanes 0, 2;  sin 2π u2  for lanes 1, 3)   (Box-Muller)

computed in float64, rounded to fp32, then to the parameter's dtype. Padded rows of the vocabulary
(beyond the serial size) are zero. Tags (set where the parameter is created,
tensor_parallel.layers.mark): "normal" N(0, std), "scaled_normal" N(0, std / sqrt(2 L)) for the
projections into the residual stream (GPT-2), "embedding" N(0, --embedding-init-method-std, default
--init-method-std) for the word and position embeddings, "ones", "zeros". A parameter without a tag is
an error, never a silent default. With --init-method-xavier-uniform (Megatron's) every normal tag is
Xavier-uniform instead: value = bound · (2u − 1), u = w / 2^32 for each of the four words (lanes 0..3),
bound = sqrt(6 / (fan_in + fan_out)) of the full (serial, unpadded) tensor.

Elementwise float kernels of torch give each element the same result whatever the length of the call
(tests/test_model_init.py checks it), so drawing a slice equals slicing the whole, bit for bit.

A parameter on a GPU is drawn there, in larger chunks (on the CPU a 1.3B-parameter model's draws take
about a minute on one core). The Philox words are the same integers; CUDA's float64 log, sqrt, cos and
sin are within its documented 1-2 ulp of the CPU's, so a value can round to a neighbouring fp32 number
only when its float64 value lies that close to a rounding boundary: about one element in 10^8 may
differ from a CPU-built model's, by one fp32 ulp. Every layout built on GPUs starts bit-identical, as
on CPUs.
"""

from __future__ import annotations

import math
import zlib

import torch

from megatron_sp.ops.philox import MASK32, philox4x32
from megatron_sp.tensor_parallel.sharding import segment_shards

INIT_DOMAIN = 0x494E4954  # "INIT" in the counter's last word; dropout's is the sample id // 2^32
# elements drawn per call on the CPU: bounds a draw's temporaries (~4 MiB; larger is no faster)
CHUNK_ELEMENTS = 1 << 16
# on a GPU: a draw is ~150 small kernels, whose launches dominate at 2^16 elements (~256 MiB of temporaries)
CHUNK_ELEMENTS_CUDA = 1 << 22


def init_std(tag: str, cfg) -> float:
    """The standard deviation of a normal tag (0 for ones/zeros)."""
    if tag == "normal":
        return cfg.init_method_std
    if tag == "scaled_normal":
        return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    if tag == "embedding":
        return cfg.init_method_std if cfg.embedding_init_method_std is None else cfg.embedding_init_method_std
    if tag in ("ones", "zeros"):
        return 0.0
    raise ValueError(f"unknown init tag {tag!r}.")


def _name_key(name: str) -> tuple[int, int]:
    return zlib.crc32(name.encode()) & MASK32, zlib.crc32(name[::-1].encode()) & MASK32


def _line_words(name: str, seed: int, first_line: int, lines: int, length: int, device=None):
    """The four Philox words [lines, ceil(length / 4)] of lines first_line .. first_line + lines - 1."""
    k0, k1 = _name_key(name)
    groups = (length + 3) // 4
    zero = torch.zeros((), dtype=torch.int64, device=device)
    c0 = torch.arange(groups, dtype=torch.int64, device=device).view(1, groups) + zero
    c1 = torch.arange(first_line, first_line + lines, dtype=torch.int64, device=device).view(lines, 1) + zero
    shape = (lines, groups)
    return philox4x32(c0.expand(shape), c1.expand(shape), zero + (seed & MASK32), zero + INIT_DOMAIN, k0, k1)


def uniform_lines(name: str, seed: int, first_line: int, lines: int, length: int, device=None) -> torch.Tensor:
    """Uniforms on [-1, 1) [lines, length] (fp32) of lines first_line .. first_line + lines - 1 of `name`."""
    words = _line_words(name, seed, first_line, lines, length, device)
    u = torch.stack([w.double() * 2.0**-32 for w in words], dim=-1).view(lines, -1)  # lanes 0..3 of each group
    return (2.0 * u[:, :length] - 1.0).float()


def normal_lines(name: str, seed: int, first_line: int, lines: int, length: int, device=None) -> torch.Tensor:
    """Standard normals [lines, length] (fp32) of lines first_line .. first_line + lines - 1 of `name`."""
    words = _line_words(name, seed, first_line, lines, length, device)  # 4 x [lines, groups]
    groups = words[0].shape[1]
    pairs = []
    for w_radius, w_angle in ((words[0], words[1]), (words[2], words[3])):
        radius = torch.sqrt(-2.0 * torch.log((w_radius.double() + 1.0) * 2.0**-32))
        angle = (2.0 * math.pi * 2.0**-32) * w_angle.double()
        pairs += [radius * torch.cos(angle), radius * torch.sin(angle)]
    z = torch.stack(pairs, dim=-1).view(lines, 4 * groups)  # lanes 0..3 of each group
    return z[:, :length].float()


def _line_runs(spec, local_lines: int, tp_rank: int, tp_size: int):
    """(local start, global start, count) of the runs of lines a rank holds (one per segment)."""
    if spec is None or spec.dim is None:
        return [(0, 0, local_lines)]
    runs, local, segment_start = [], 0, 0
    for shard in segment_shards(spec, local_lines, tp_rank, tp_size):
        runs.append((local, segment_start + shard.offset, shard.size))
        local += shard.size
        segment_start += shard.full
    return runs


@torch.no_grad()
def initialise_(param: torch.Tensor, name: str, tag: str, spec, cfg, tp_rank: int = 0, tp_size: int = 1):
    """Fills `param` (this rank's shard, any dtype and device) with its slice of the serial tensor
    (see the module docstring); spec: its ShardSpec, or None for a replicated tensor."""
    std = init_std(tag, cfg)
    if tag in ("ones", "zeros"):
        return param.fill_(1.0 if tag == "ones" else 0.0)
    axis = 0 if spec is None or spec.dim is None else spec.dim % param.dim()
    lines_view = param.movedim(axis, 0)  # [local lines, ...]: a view of param
    full = spec.full if spec is not None and spec.full is not None else None
    length = lines_view[0].numel() if lines_view.shape[0] else 0
    on_gpu = param.device.type == "cuda"  # (drawn there; anything else on the CPU)
    device = param.device if on_gpu else None
    per_chunk = max(1, (CHUNK_ELEMENTS_CUDA if on_gpu else CHUNK_ELEMENTS) // max(length, 1))
    if cfg.init_method_xavier_uniform:  # Megatron's: every normal init Xavier's, on the full tensor's fans
        draw, scale = uniform_lines, _xavier_bound(param, spec, axis, tp_size)
    else:
        draw, scale = normal_lines, std
    for local, first, count in _line_runs(spec, lines_view.shape[0], tp_rank, tp_size):
        real = count if full is None else max(0, min(count, full - first))  # rows past `full`: padding
        for start in range(0, real, per_chunk):
            n = min(per_chunk, real - start)
            block = draw(name, cfg.seed, first + start, n, length, device).mul_(scale)
            lines_view[local + start : local + start + n].copy_(block.view((n,) + tuple(lines_view.shape[1:])))
        lines_view[local + real : local + count].zero_()
    return param


def _xavier_bound(param: torch.Tensor, spec, axis: int, tp_size: int) -> float:
    """sqrt(6 / (fan_in + fan_out)) of the full (serial, unpadded) tensor, as torch.nn.init's."""
    shape = list(param.shape)
    if spec is not None and spec.dim is not None:
        shape[axis] = sum(spec.segments) if spec.segments else spec.full or shape[axis] * tp_size
    if len(shape) < 2:
        raise ValueError("--init-method-xavier-uniform needs parameters of at least 2 dimensions.")
    receptive = math.prod(shape[2:])
    return math.sqrt(6.0 / (shape[1] * receptive + shape[0] * receptive))


def check_init_tags(module) -> None:
    """Every parameter must say how it is initialised."""
    untagged = [name for name, p in module.named_parameters() if getattr(p, "init_tag", None) is None]
    if untagged:
        raise ValueError(
            f"parameter {untagged[0]} has no init tag: create it with "
            f"megatron_sp.tensor_parallel.layers.mark(param, init=...) (normal, scaled_normal, "
            f"ones or zeros) or through the builder's column/row layers"
            f"{f' ({len(untagged) - 1} more untagged)' if len(untagged) > 1 else ''}."
        )


def torch_dtype(precision: str) -> torch.dtype:
    """GPTConfig.params_dtype ("fp32", "bf16", "fp16") as a torch dtype."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
