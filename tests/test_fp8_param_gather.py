"""--fp8-param-gather (megatron_sp/distributed/fp8_param_gather.py), under the distributed optimizer
(the owners' FP8 broadcast) and under FSDP2 (its all-gather extension).

- bf16 holds an FP8 value exactly: the GEMM's cast of q / scale (rounded to bf16) with the same scale
  gives q back bit for bit, subnormals and saturation included (fp16 does not: its range underflows).
- The program at TP2+SP × DP2 (4 gloo ranks, bf16, hybrid FP8): after its steps every rank's FP8 weight
  (under FSDP2: what its all-gather gives) is, bit for bit, the cast of the whole tensor's fp32 main
  weight with the whole tensor's scale (the reference gathers the owners' main weights, or FSDP2's fp32
  shards, and reduces the amax itself), for tensorwise and delayed scaling; a planted bug that scales
  each TP shard by its own amax fails it.
- The weights move in FP8: one byte per FP8 weight element (the distributed optimizer broadcasts the
  rest in bf16 as before; FSDP2's all-gather input of an FP8 weight is its padded shard in uint8).
- Delayed scaling resumes exactly under both: 2 iterations, a save, 2 more log the straight run's
  losses bit for bit; and the losses stay within FP8's drift of the run without the flag.
"""

import os

import pytest
import torch

pytest.importorskip("torchao", reason="FP8 needs torchao (requirements.txt)")

from launch_helpers import TINY, losses  # noqa: E402

from megatron_sp.tensor_parallel import fp8 as fp8_gemms  # noqa: E402
from megatron_sp.testing import LocalWorld  # noqa: E402

E4M3 = torch.float8_e4m3fn
RUN = TINY + ["--mock-data", "--bf16", "--fp8-format", "hybrid", "--lr", "1e-3"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # × DP 2 in the 4-rank world
FP8_VS_NO_GATHER = 2e-3  # the losses with and without the flag (one rounding of the weights less): measured 1.0e-4


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(4)
    yield w
    w.close()


def test_bf16_holds_an_fp8_value_exactly():
    g = torch.Generator().manual_seed(0)
    main = torch.cat([torch.randn(4096, generator=g) * m for m in (1e-6, 1e-3, 0.02, 1.0, 300.0)])
    amax = main.abs().max()
    for scale in (fp8_gemms.amax_to_scale(amax, E4M3), torch.tensor(0.25) * 448 / amax, torch.tensor(1e5)):
        q = fp8_gemms.to_fp8(main, scale, E4M3)  # (the second scale saturates, the third makes subnormals)
        held = (q.float() / scale).to(torch.bfloat16)
        assert torch.equal(fp8_gemms.to_fp8(held, scale, E4M3).view(torch.uint8), q.view(torch.uint8))
        gemm = fp8_gemms._cast(held.view(-1, 1024).t(), scale, E4M3, 1)._data  # what the forward casts
        assert torch.equal(gemm.view(torch.uint8), q.view(-1, 1024).t().view(torch.uint8))
    scale = torch.tensor(448.0 / 1e-3)  # (a weight of amax 1e-3)
    q = fp8_gemms.to_fp8(torch.tensor([2.0**-9]) / scale, scale, E4M3)  # e4m3's smallest subnormal
    as_fp16 = (q.float() / scale).to(torch.float16)  # (why --bf16 is required)
    assert q.float().item() != 0 and not torch.equal(fp8_gemms.to_fp8(as_fp16, scale, E4M3), q)


def _train(argv, cwd, per_shard=False):
    """One rank: the program, then per FP8 weight whether it is the cast of the whole fp32 main weight."""
    import torch.distributed as dist

    from megatron_sp.distributed.fp8_param_gather import fp8_weights
    from megatron_sp.training import pretrain
    from megatron_sp.training.arguments import parse_args

    os.chdir(cwd)
    args = parse_args(argv, world_size=dist.get_world_size())
    args.distributed_backend = "gloo"
    reduce_amax = fp8_gemms.reduce_amax
    if per_shard:  # the planted bug: each shard's own amax
        fp8_gemms.reduce_amax = lambda amaxes, groups: amaxes
    try:
        trainer = pretrain.Trainer(pretrain.check_inputs(args))
        assert trainer.run() == 0
    finally:
        fp8_gemms.reduce_amax = reduce_amax
    if args.use_torch_fsdp2:
        return _fsdp2_probe(trainer)
    opt, ps = trainer.optimizer, trainer.ps
    mains = {id(p): main for p, main in opt.pairs}
    layers = fp8_weights(trainer.model)
    full = []
    for w, fp8 in layers:
        main = mains.get(id(w), torch.zeros(w.shape)).clone()
        dist.all_reduce(main, group=ps.replica_group)  # (one owner: the sum is its main weight)
        full.append(main)
    wrong = _wrong([w for w, _ in layers], [fp8 for _, fp8 in layers], full, ps.tp_group)
    fp8 = {id(w) for w, _ in fp8_weights(trainer.model)}
    return {
        "wrong": wrong,
        "fp8_bytes": sum(e.bytes.numel() * e.bytes.element_size() for e in opt.fp8_gather.owners),
        "fp8_numel": sum(p.numel() for p in trainer.model.parameters() if id(p) in fp8),
        "bf16_numel": sum(flat.numel() for _, _, flat in opt.broadcast.buffers),
        "other_numel": sum(p.numel() for p in trainer.model.parameters() if id(p) not in fp8),
    }


def _fsdp2_probe(trainer):
    """Under FSDP2: the weights its all-gathers give (unshard()), against the cast of the fp32 shards
    gathered; each FP8 weight's all-gather input is one byte per element of its (padded) shard."""
    from torch.distributed.fsdp import FSDPModule

    from megatron_sp.distributed.fsdp import reshard

    model, hooks = trainer.model, trainer.optimizer.fp8_weights
    layers = [m for m in model.modules() if getattr(m, "fp8", None) is not None and m.weight is not None]
    full = [m.weight.full_tensor() for m in layers]  # (fp32: FSDP2's shards are the main weights)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
    wrong = _wrong([m.weight for m in layers], [m.fp8 for m in layers], full, trainer.ps.tp_group)
    reshard(model)
    padded = sum(h.param.padded_sharded_param_size.numel() for h in hooks)
    return {
        "wrong": wrong,
        "fp8_bytes": sum(h.bytes.numel() * h.bytes.element_size() for h in hooks),
        "fp8_numel": padded,
        "bf16_numel": 0,
        "other_numel": 0,
    }


def _wrong(weights, gemms, mains, tp_group) -> list:
    """Per FP8 weight: its elements that are not the cast of its whole fp32 main weight with the whole
    tensor's scale, plus one if the layer holds another scale."""
    import torch.distributed as dist

    wrong = []
    for w, fp8, main in zip(weights, gemms, mains):
        amax = main.abs().max()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
        scale = fp8.delayed.current(fp8_gemms.WEIGHT, "cpu") if fp8.delayed else fp8_gemms.amax_to_scale(amax, E4M3)
        want = (fp8_gemms.to_fp8(main, scale, E4M3).float() / scale).to(torch.bfloat16)
        wrong.append(int((w != want).sum()) + int(not torch.equal(fp8.weight_scale, scale)))
    return wrong


SHARDING = {
    "distributed-optimizer": ["--use-distributed-optimizer"],
    "fsdp2": ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
}


@pytest.mark.parametrize("sharding", ["distributed-optimizer", "fsdp2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_every_rank_holds_the_cast_of_the_whole_main_weight(world, tmp_path, recipe, sharding):
    argv = RUN + LAYOUT + SHARDING[sharding] + ["--fp8-recipe", recipe, "--fp8-param-gather", "--train-iters", "2"]
    results = world.run(_train, argv, str(tmp_path))
    assert all(r["wrong"] and not any(r["wrong"]) for r in results), [r["wrong"] for r in results]
    # The FP8 weights move as one byte per element; the distributed optimizer's others in bf16 as before.
    assert all(r["fp8_bytes"] == r["fp8_numel"] > 0 and r["bf16_numel"] == r["other_numel"] for r in results)
    print("per rank: FP8 weight elements", results[0]["fp8_numel"], "others", results[0]["other_numel"])


@pytest.mark.parametrize("sharding", list(SHARDING))
def test_per_shard_scales_fail(world, tmp_path, sharding):
    argv = RUN + LAYOUT + SHARDING[sharding] + ["--fp8-recipe", "tensorwise", "--fp8-param-gather"]
    argv += ["--train-iters", "1"]
    results = world.run(_train, argv, str(tmp_path), True)
    assert sum(sum(r["wrong"]) for r in results) > 1000, [r["wrong"] for r in results]


def _losses(argv, cwd, log):
    from megatron_flag_sets_helpers import train_in_world

    assert train_in_world(argv + ["--log-jsonl", log], cwd) == 0


@pytest.mark.parametrize("sharding", list(SHARDING))
def test_delayed_scaling_resumes_exactly(world, tmp_path, sharding):
    """2 + 2 iterations through a checkpoint log the straight run's 4 losses, which stay within
    FP8_VS_NO_GATHER of the run without the flag."""
    run = RUN + SHARDING[sharding] + ["--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    run += ["--lr-decay-iters", "4"]
    ckpt = str(tmp_path / "ckpt")

    def train(extra, log):
        world.run(_losses, run + extra, str(tmp_path), str(tmp_path / log))
        return losses(tmp_path / log)

    plain = train(["--train-iters", "4"], "plain.jsonl")
    straight = train(["--fp8-param-gather", "--train-iters", "4"], "straight.jsonl")
    train(["--fp8-param-gather", "--train-iters", "2", "--save", ckpt], "first.jsonl")
    assert train(["--fp8-param-gather", "--train-iters", "4", "--load", ckpt], "resumed.jsonl") == straight[2:]
    drift = [abs(a - b) / b for a, b in zip(straight, plain)]
    print("with vs without --fp8-param-gather", drift)
    assert 0 < max(drift) <= FP8_VS_NO_GATHER, drift


@pytest.mark.parametrize(
    "flags,needle",
    [
        ([], "needs --use-distributed-optimizer, --use-torch-fsdp2 or --use-megatron-fsdp"),
        (["--use-distributed-optimizer"], "needs --bf16"),
        (["--use-distributed-optimizer", "--bf16", "--fp8-recipe", "mxfp8"], "tensorwise or delayed"),
        (["--use-distributed-optimizer", "--bf16", "--fp8-recipe", "rowwise"], "tensorwise or delayed"),
    ],
)
def test_refusals_are_one_sentence(flags, needle):
    from megatron_sp.training.arguments import ArgumentError, parse_args
    from megatron_sp.training.pretrain import check_inputs

    argv = ["--mock-data", "--device", "cpu", "--fp8-format", "hybrid", "--fp8-param-gather"] + flags
    with pytest.raises((ArgumentError, ValueError)) as err:
        check_inputs(parse_args(argv, world_size=2))
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
