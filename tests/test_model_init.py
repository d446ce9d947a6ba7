"""Initialisation by shard (models/init.py): every element is a pure function of (seed, name, index in
the full tensor), so a rank draws exactly its shard and the shards of any TP size make up the serial
tensor bit for bit; the draws are standard normals. (test_parity.py checks the whole model: GPTModel
at TP 1/2/4 starts equal to ReferenceGPT.)"""

import pytest
import torch

from megatron_sp.config import GPTConfig
from megatron_sp.models import init
from megatron_sp.tensor_parallel.sharding import ShardSpec, local_dim_size, shard_full

CFG = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=97, seq_length=32)


def test_a_slice_of_lines_is_the_slice_of_the_whole_draw():
    """Lines drawn alone, in runs or all at once, of any length: the same bits (no element depends on
    the call that draws it)."""
    whole = init.normal_lines("layers.0.mlp.fc1.weight", 1234, 0, 37, 131)
    assert torch.equal(
        torch.cat([init.normal_lines("layers.0.mlp.fc1.weight", 1234, i, 1, 131) for i in range(37)]), whole
    )
    assert torch.equal(init.normal_lines("layers.0.mlp.fc1.weight", 1234, 5, 9, 131), whole[5:14])
    assert torch.equal(init.normal_lines("layers.0.mlp.fc1.weight", 1234, 3, 4, 7), whole[3:7, :7])


def test_draws_are_standard_normals_and_keyed_by_seed_name_and_line():
    z = init.normal_lines("w", 1, 0, 256, 4096).double()
    assert abs(z.mean().item()) < 5e-3 and abs(z.std().item() - 1.0) < 5e-3
    assert abs((z**4).mean().item() - 3.0) < 0.05  # a normal's kurtosis
    lanes = z.view(256, -1, 4)  # cos and sin of one angle: uncorrelated
    assert abs((lanes[..., 0] * lanes[..., 1]).mean().item()) < 5e-3
    others = [init.normal_lines("w", 2, 0, 1, 64), init.normal_lines("v", 1, 0, 1, 64), z[1:2, :64].float()]
    for other in others:
        assert not torch.equal(other, z[:1, :64].float())


# (name, full shape, tag, ShardSpec as the layers build it)
PARAMS = [
    ("embedding.word_embeddings.weight", (97, 64), "normal", ShardSpec(0, full=97)),  # padded vocab rows
    ("layers.0.attn.qkv.weight", (192, 64), "normal", ShardSpec(0, (128, 32, 32), (4, 1, 1))),  # GQA copies
    ("layers.0.attn.proj.weight", (64, 128), "scaled_normal", ShardSpec(1)),  # columns
    ("layers.0.mlp.fc1.weight", (256, 64), "normal", ShardSpec(0, (128, 128))),  # SwiGLU halves
    ("embedding.position_embeddings.weight", (32, 64), "normal", ShardSpec()),  # replicated
    ("layers.0.ln1.weight", (64,), "ones", ShardSpec()),
]


def _local_shape(full_shape, spec, tp):
    if spec.dim is None:
        return full_shape
    shape = list(full_shape)
    padded = -(-full_shape[spec.dim] // (128 * tp)) * 128 * tp if spec.full is not None else full_shape[spec.dim]
    shape[spec.dim] = local_dim_size(spec, padded, tp)
    return tuple(shape)


@pytest.mark.parametrize("name,full_shape,tag,spec", PARAMS)
def test_each_rank_draws_exactly_its_shard(monkeypatch, name, full_shape, tag, spec):
    """At TP 2 and 4 every rank's shard is the slice of the serial tensor (its padded rows zero),
    drawing only the lines it holds (never the whole tensor)."""
    serial = init.initialise_(torch.empty(full_shape), name, tag, spec, CFG)
    drawn = []
    real = init.normal_lines
    monkeypatch.setattr(init, "normal_lines", lambda *a, **k: drawn.append(a[3] * a[4]) or real(*a, **k))
    for tp in (2, 4):
        local_shape = _local_shape(full_shape, spec, tp)
        for rank in range(tp):
            drawn.clear()
            shard = init.initialise_(torch.empty(local_shape), name, tag, spec, CFG, rank, tp)
            assert torch.equal(shard, shard_full(serial, spec, local_shape, rank, tp)), (tp, rank)
            assert sum(drawn) <= shard.numel(), (tp, rank, sum(drawn), shard.numel())


def test_shards_gather_back_to_the_serial_tensor_in_low_precision():
    """bf16 parameters hold the fp32 draw rounded once; the gathered TP=4 shards equal the serial one."""
    name, full_shape, tag, spec = PARAMS[2]
    serial = init.initialise_(torch.empty(full_shape, dtype=torch.bfloat16), name, tag, spec, CFG)
    assert torch.equal(serial, init.initialise_(torch.empty(full_shape), name, tag, spec, CFG).bfloat16())
    shards = [init.initialise_(torch.empty(64, 32, dtype=torch.bfloat16), name, tag, spec, CFG, r, 4) for r in range(4)]
    assert torch.equal(torch.cat(shards, dim=1), serial)


@pytest.mark.cuda
@pytest.mark.parametrize("name,full_shape,tag,spec", PARAMS)
def test_a_gpu_draws_its_shards_there_as_the_cpu_does(name, full_shape, tag, spec):
    """On a GPU the draws run there (models/init.py): every TP rank's shard is the slice of the GPU's
    serial tensor bit for bit, and the serial tensor is the CPU's but for rare one-ulp roundings of
    CUDA's float64 functions (at most one element in 10^5 here, expected about one in 10^8)."""
    cpu = init.initialise_(torch.empty(full_shape), name, tag, spec, CFG)
    serial = init.initialise_(torch.empty(full_shape, device="cuda"), name, tag, spec, CFG)
    assert serial.device.type == "cuda"
    differ = (serial.cpu() != cpu).sum().item()
    assert differ <= max(1, cpu.numel() // 10**5), differ
    torch.testing.assert_close(serial.cpu(), cpu, rtol=2**-23, atol=0)
    for tp in (2, 4):
        local_shape = _local_shape(full_shape, spec, tp)
        for rank in range(tp):
            shard = init.initialise_(torch.empty(local_shape, device="cuda"), name, tag, spec, CFG, rank, tp)
            assert torch.equal(shard, shard_full(serial, spec, local_shape, rank, tp)), (tp, rank)


@pytest.mark.parametrize("name,full_shape,tag,spec", [p for p in PARAMS if len(p[1]) == 2])
def test_xavier_uniform_is_drawn_by_shard_with_the_full_tensors_fans(name, full_shape, tag, spec):
    """--init-method-xavier-uniform: U(-b, b) with torch.nn.init's b = sqrt(6 / (fan_in + fan_out)) of
    the serial (unpadded) tensor, and still every rank's shard the slice of the serial draw."""
    import dataclasses

    cfg = dataclasses.replace(CFG, init_method_xavier_uniform=True)
    fan_in, fan_out = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(full_shape))
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    serial = init.initialise_(torch.empty(full_shape), name, tag, spec, cfg)
    assert serial.abs().max() <= bound and serial.abs().max() > 0.95 * bound
    assert abs(serial.var().item() / (bound**2 / 3) - 1) < 0.1  # a uniform's variance
    local_shape = _local_shape(full_shape, spec, 4)
    for rank in range(4):
        shard = init.initialise_(torch.empty(local_shape), name, tag, spec, cfg, rank, 4)
        assert torch.equal(shard, shard_full(serial, spec, local_shape, rank, 4)), rank


BUILD_PROBE = """
import sys
import torch
from megatron_sp.config import GPTConfig
from megatron_sp.models import init
from megatron_sp.models.builders import SerialBuilder
from megatron_sp.models.language_model import LanguageModel

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

cfg = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=97, seq_length=32)
LanguageModel(cfg, SerialBuilder())  # the meta build, learned positions included
w = torch.zeros(1024, 1024)  # 4 MiB, resident
init.initialise_(w[:8], "warm", "normal", None, cfg)
before = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
init.initialise_(w, "layers.0.mlp.fc1.weight", "normal", None, cfg)
print("sympy" in sys.modules, rss("VmHWM") - before)
"""


def test_building_a_model_holds_no_transient_beyond_a_small_chunk():
    """Issue 30.6, in a fresh interpreter as a user's: the meta build imports no sympy (a normal_ on the
    meta device would: ~70 MiB resident), and drawing a 4 MiB parameter in place peaks under 8 MiB
    above it (2^20-element chunks held ~37 MiB; bench/build_memory.py measures whole models)."""
    import os
    import subprocess
    import sys

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    out = subprocess.run([sys.executable, "-c", BUILD_PROBE], capture_output=True, text=True, timeout=120, check=True)
    imported_sympy, peak = out.stdout.split()
    assert imported_sympy == "False"
    assert int(peak) < 8 * 2**20, f"the draw's transient peak was {int(peak) / 2**20:.1f} MiB"
