"""Mixture of experts in the real program (issue 31, items 3-4): pretrain_gpt_sp.py's logged losses
(lm loss, load-balancing loss and z-loss) at EP2 (× DP 4) and EP2 × TP2+SP equal a single process's
within 1e-5, with dropout, sigmoid routing and the expert bias (aux-loss-free balancing, updated after
every step) on; the EP2 run's checkpoint (per-expert entries, expert biases, the distributed
optimizer's state) resumes at EP4, at EP1 and at EP2 × expert-TP 2 (TP2+SP) on the uninterrupted
curve; --moe-per-layer-logging writes each layer's losses; the FLOPs count the active experts only.

The aux loss is that of the micro-batch of every DP rank together (docs/models.md), so the single
process takes one micro-batch of the global batch of 4 where the DP ranks each take their share."""

import json
import math

import pytest
import torch.distributed as dist

from megatron_sp.testing import LocalWorld
from megatron_sp.training import pretrain
from megatron_sp.training.arguments import ArgumentError, parse_args

WORLD = 4
RUN = [
    "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--model", "llama", "--group-query-attention", "--num-query-groups", "2",
    "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
    "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--moe-layer-freq", "1",
    "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--lr-warmup-iters", "1",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--no-progress-bar",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--distributed-backend", "gloo", "--use-distributed-optimizer",
]  # fmt: skip
NAMES = ("lm_loss", "load_balancing_loss", "z_loss", "grad_norm")  # (the norm: each expert shard once)


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(WORLD)
    yield w
    w.close()


def _in_world(argv):
    args = parse_args(argv, world_size=dist.get_world_size())
    return pretrain.Trainer(pretrain.check_inputs(args)).run()


def _steps(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if "lm_loss" in r]


def _close(got, want, names=NAMES):
    for g, w in zip(got, want):
        for name in names:
            assert abs(g[name] - w[name]) <= 1e-5 * abs(w[name]), (name, g[name], w[name])


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serial")
    argv = RUN + ["--micro-batch-size", "4", "--log-jsonl", str(tmp / "log.jsonl"), "--moe-per-layer-logging"]
    argv = [a for a in argv if a != "--use-distributed-optimizer"]  # one replica
    assert pretrain.main(argv) == 0
    return _steps(tmp / "log.jsonl")


def test_serial_run_logs_the_losses_per_layer(serial):
    assert len(serial) == 4 and all(math.isfinite(r[n]) for r in serial for n in NAMES)
    layers = serial[0]["moe_layers"]
    assert set(layers) == {f"moe/{n}_layer_{i}" for n in ("load_balancing_loss", "z_loss") for i in (1, 2)}
    mean = (layers["moe/z_loss_layer_1"] + layers["moe/z_loss_layer_2"]) / 2
    assert abs(serial[0]["z_loss"] - mean) < 1e-9


@pytest.mark.parametrize(
    "layout,micro",
    [(["--expert-model-parallel-size", "2"], "1"), (["--tensor-model-parallel-size", "2", "--sequence-parallel",
     "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], "2")],
    ids=["ep2-dp4", "ep2-tp2+sp"],
)  # fmt: skip
def test_expert_parallel_program_logs_the_serial_losses(world, serial, tmp_path, layout, micro):
    log = tmp_path / "log.jsonl"
    argv = RUN + layout + ["--micro-batch-size", micro, "--log-jsonl", str(log), "--exit-interval", "2"]
    resumes = "--sequence-parallel" not in layout
    assert world.run(_in_world, argv + (["--save", str(tmp_path / "ckpt")] if resumes else [])) == [0] * WORLD
    _close(_steps(log), serial[:2])
    if not resumes:
        return
    _fsdp2_resumes_and_saves(world, serial, tmp_path)
    etp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2"]
    for name, other in (("ep4", ["4", "1"]), ("ep1", ["1", "1"]), ("ep2-etp2", ["2", "2"] + etp2)):
        resumed = tmp_path / f"{name}.jsonl"  # the EP2 checkpoint at another EP / expert-TP: the serial curve
        again = RUN + ["--expert-model-parallel-size", other[0], "--micro-batch-size", other[1], *other[2:]]
        ckpt = tmp_path / ("fsdp2" if name == "ep1" else "ckpt")  # (EP1 reads FSDP2's, from iteration 3)
        assert world.run(_in_world, again + ["--log-jsonl", str(resumed), "--load", str(ckpt)]) == [0] * 4
        steps = _steps(resumed)
        assert [r["iteration"] for r in steps] == ([4] if name == "ep1" else [3, 4])
        _close(steps, serial[2:] if name != "ep1" else serial[3:])
    _generates_from(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def serial_micro2(tmp_path_factory):
    """The single process at micro-batches of 2 (the pipeline run's: 1 sample × DP 2), each layer logged."""
    tmp = tmp_path_factory.mktemp("serial2")
    argv = RUN + ["--micro-batch-size", "2", "--log-jsonl", str(tmp / "log.jsonl"), "--moe-per-layer-logging"]
    assert pretrain.main([a for a in argv if a != "--use-distributed-optimizer"]) == 0
    return _steps(tmp / "log.jsonl")


def test_pipeline_expert_parallel_program_resumes_on_the_serial_curve(world, serial_micro2, tmp_path):
    """PP2 × EP2 (1F1B, EP over the stage's 2 DP ranks, one MoE layer per stage): the logged lm loss,
    both layers' load-balancing and z losses (each from its own stage) and the norm equal the single
    process's; the run saved at iteration 2 and resumed logs iterations 3 and 4 of the same curve."""
    log, ckpt = tmp_path / "log.jsonl", str(tmp_path / "ckpt")
    argv = RUN + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--micro-batch-size", "1"]
    argv += ["--log-jsonl", str(log), "--moe-per-layer-logging"]
    assert world.run(_in_world, argv + ["--exit-interval", "2", "--save", ckpt]) == [0] * WORLD
    assert world.run(_in_world, argv + ["--load", ckpt]) == [0] * WORLD
    steps = _steps(log)
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4]
    _close(steps, serial_micro2)
    layers = [{"moe_layers": r["moe_layers"]} for r in steps]
    for got, want in zip(layers, serial_micro2):
        assert set(got["moe_layers"]) == set(want["moe_layers"])
        _close([got["moe_layers"]], [want["moe_layers"]], names=tuple(want["moe_layers"]))


def _fsdp2_resumes_and_saves(world, serial, tmp_path):
    """--use-torch-fsdp2 at EP2 (experts sharded over expert-DP 2, the rest over DP 4) resumes the EP2
    checkpoint of iteration 2 for one step on the serial curve and saves its own (gathered from the
    shards, expert biases included), which EP1 then resumes."""
    fsdp = [a for a in RUN if a != "--use-distributed-optimizer"] + ["--use-torch-fsdp2", "--micro-batch-size", "1"]
    fsdp += ["--expert-model-parallel-size", "2", "--load", str(tmp_path / "ckpt"), "--exit-interval", "3"]
    log = tmp_path / "fsdp2.jsonl"
    assert world.run(_in_world, fsdp + ["--save", str(tmp_path / "fsdp2"), "--log-jsonl", str(log)]) == [0] * WORLD
    steps = _steps(log)
    assert [r["iteration"] for r in steps] == [3]
    _close(steps, serial[2:3])


def _generates_from(ckpt):
    """tools/generate.py's model from the EP2 checkpoint: every expert and expert bias, the serial model."""
    import torch

    from tools.generate import load_model

    model, cfg = load_model(str(ckpt))
    names = dict(model.named_parameters())
    assert sum(".experts.local_experts." in n and n.endswith("fc1.weight") for n in names) == 2 * 4
    assert model.layers[0].mlp.router.expert_bias.abs().sum() > 0  # moved by two updates, restored
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 512)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--num-experts", "4", "--expert-model-parallel-size", "3"], "must divide the 4 ranks of a pipeline stage"),
        (["--num-experts", "6", "--expert-model-parallel-size", "4"], "divisible by --expert-model-parallel-size"),
        (["--moe-router-topk", "3", "--num-experts", "2"], "must not exceed --num-experts"),
        (["--moe-expert-capacity-factor", "1.0"], "needs --num-experts"),
        (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], "need --moe-expert-capacity-factor"),
        (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], "needs DeepEP"),
    ],
)
def test_bad_moe_flags_are_one_sentence(flags, needle):
    with pytest.raises((ArgumentError, ValueError)) as err:
        args = parse_args(["--mock-data"] + flags, world_size=WORLD)
        pretrain.build_config(args, 512)
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1


def test_flops_count_the_active_experts():
    from megatron_sp.config import GPTConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=32, model="llama")
    dense = GPTConfig(**base, ffn_hidden_size=32)
    moe = GPTConfig(**base, num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2)
    h, f = 64, 32
    per_expert = 3 * h * f  # SwiGLU: gate, up and down
    assert moe.num_parameters() - dense.num_parameters() == 2 * (7 * per_expert + h * 8)
    assert moe.flops_per_token() - dense.flops_per_token() == 6 * 2 * (per_expert + h * 8)
