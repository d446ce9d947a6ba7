"""Megatron-LM checkpoints in (megatron_sp/checkpointing/megatron*.py), against checkpoints that
megatron-core 0.16.1 itself wrote (tests/megatron_fixtures.py, made once per module): both formats,
TP1 / TP2 / PP2, GPT-2- and Llama-style with every parameter perturbed, and a mixture of experts (its
MoELayer: router, expert bias, SequentialMLP experts, gated shared expert, learnt attention sinks, a
sliding window) at EP1 / EP2, virtual pipeline stages and an uneven first stage; our model of the
converted tensors gives megatron-core's logits within 1e-5; planted damage is refused in one sentence."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_sp.checkpointing.megatron import read_model
from megatron_sp.checkpointing.megatron_model import config_fields
from megatron_sp.checkpointing.paths import CheckpointError
from megatron_sp.models.reference import ReferenceGPT

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("tp1_dist", "tp2_dist", "pp2_dist", "tp1_torch", "tp2_torch", "pp2_torch")
MOE_LAYOUTS = ("ep1_dist", "ep1_torch", "ep2_dist", "ep2_torch", "vpp_dist", "vpp_torch", "pp2_uneven_torch")
ITER = "iter_0000010"


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "megatron_fixtures.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return str(out)


def _logits(state, cfg, tokens):
    model = ReferenceGPT(cfg, initialise=False)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.parametrize("family", ["gpt2", "llama", "moe"])
def test_every_layout_gives_megatron_cores_logits(fixtures, family):
    ref = torch.load(os.path.join(fixtures, family, "logits.pt"))
    layouts = MOE_LAYOUTS if family == "moe" else LAYOUTS + (("tp2_dist_head",) if family == "llama" else ())
    first = None
    for layout in layouts:
        state, cfg, ckpt = read_model(os.path.join(fixtures, family, layout))
        out = _logits(state, cfg, ref["tokens"])
        expected = ref["logits"][..., : cfg.vocab_size]  # the padded rows are dropped (vocab 100 of 128)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=f"{family} {layout}")
        assert ckpt.common["iteration"] == 10 and ckpt.format == ("torch" if "torch" in layout else "torch_dist")
        if first is None:
            first = state
        else:  # every layout holds the same tensors, bit for bit
            assert all(torch.equal(first[k], state[k]) for k in first), layout


def test_config_comes_from_args(fixtures):
    _, llama, _ = read_model(os.path.join(fixtures, "llama", "tp1_torch"))
    assert (llama.normalization, llama.activation, llama.position_embedding_type) == ("RMSNorm", "swiglu", "rope")
    assert (llama.num_query_groups, llama.qk_layernorm, llama.rotary_base, llama.ffn_hidden_size) == (
        2,
        True,
        20000,
        128,
    )
    assert llama.untie_embeddings_and_output_weights and not llama.add_bias_linear and llama.model == "llama"
    _, gpt2, _ = read_model(os.path.join(fixtures, "gpt2", "tp2_dist"))
    assert (gpt2.normalization, gpt2.position_embedding_type, gpt2.activation) == (
        "LayerNorm",
        "learned_absolute",
        "gelu",
    )
    assert not gpt2.untie_embeddings_and_output_weights and gpt2.add_bias_linear and gpt2.vocab_size == 100
    _, moe, _ = read_model(os.path.join(fixtures, "moe", "ep2_torch"))
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size, moe.moe_layer_freq) == (
        4,
        2,
        32,
        (0, 1, 1, 0),
    )
    assert (moe.moe_router_score_function, moe.moe_router_topk_scaling_factor) == ("sigmoid", 2.0)
    assert moe.moe_router_enable_expert_bias and moe.moe_shared_expert_gate
    assert moe.moe_shared_expert_intermediate_size == 64 and moe.moe_router_load_balancing_type == "seq_aux_loss"
    assert (moe.softmax_type, moe.window_size) == ("learnable", (5, 0))


def test_older_and_newer_norm_names():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128, max_position_embeddings=8)
    old = config_fields(argparse.Namespace(**base, norm_epsilon=1e-6, apply_layernorm_1p=True), "old")
    new = config_fields(argparse.Namespace(**base, layernorm_epsilon=1e-6, layernorm_zero_centered_gamma=True), "new")
    for fields in (old, new):
        assert fields["layernorm_epsilon"] == 1e-6 and fields["layernorm_zero_centered_gamma"] is True
    assert config_fields(argparse.Namespace(**base), "default")["layernorm_epsilon"] == 1e-5


def _copy(fixtures, family, layout, tmp_path):
    dst = tmp_path / layout
    shutil.copytree(os.path.join(fixtures, family, layout), dst)
    return dst


def _refused(root, match):
    with pytest.raises(CheckpointError, match=match) as err:
        read_model(str(root))
    message = str(err.value)
    assert "\n" not in message and message.endswith("."), message
    return message


def _rewrite(file, change):
    data = torch.load(file, weights_only=False)
    change(data)
    torch.save(data, file)


def test_planted_damage_is_refused(fixtures, tmp_path):
    # a missing layer: the last stage's file gone, or one layer's tensors removed from it
    root = _copy(fixtures, "llama", "pp2_torch", tmp_path)
    stage = root / ITER / "mp_rank_00_001" / "model_optim_rng.pt"
    _rewrite(stage, lambda d: d["model"].pop("decoder.layers.0.mlp.linear_fc2.weight"))
    _refused(root, "lacks decoder.layers.1.mlp.linear_fc2.weight")
    shutil.rmtree(stage.parent)
    _refused(root, "PP rank 1, EP rank 0 missing")
    # q/k/v rows in the order of checkpoints before version 2.0
    root = _copy(fixtures, "gpt2", "tp1_torch", tmp_path)
    rank = root / ITER / "mp_rank_00" / "model_optim_rng.pt"
    _rewrite(rank, lambda d: d.update(checkpoint_version=1.0))
    _refused(root, "checkpoint_version 1.0")
    # a tensor the model has no place for, and a shape its args do not give
    _rewrite(rank, lambda d: (d.update(checkpoint_version=3.0), d["model"].update(extra=torch.zeros(1))))
    _refused(root, "holds extra")
    _rewrite(
        rank, lambda d: (d["model"].pop("extra"), d["model"].update({"decoder.final_layernorm.weight": torch.ones(3)}))
    )
    _refused(root, "decoder.final_layernorm.weight of shape")
    # an option megatron_sp lacks
    _rewrite(rank, lambda d: setattr(d["args"], "multi_latent_attention", True))
    _refused(root, "--multi-latent-attention")
    # experts: one missing on its EP rank, an EP rank's file gone, a chunk of the virtual stages gone
    root = _copy(fixtures, "moe", "ep2_torch", tmp_path)
    rank = root / ITER / "mp_rank_00_001" / "model_optim_rng.pt"
    _rewrite(rank, lambda d: d["model"].pop("decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"))
    _refused(root, "lacks decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight")
    shutil.rmtree(rank.parent)
    _refused(root, "EP rank 1 missing")
    root = _copy(fixtures, "moe", "vpp_torch", tmp_path)
    _rewrite(root / ITER / "mp_rank_00_001" / "model_optim_rng.pt", lambda d: d.pop("model1"))
    _refused(root, "needs model0, model1")
    root = _copy(fixtures, "moe", "ep1_torch", tmp_path)
    _rewrite(root / ITER / "mp_rank_00" / "model_optim_rng.pt", lambda d: setattr(d["args"], "add_bias_linear", True))
    _refused(root, "router then has a bias")
    # a truncated .distcp
    root = _copy(fixtures, "llama", "tp2_dist", tmp_path)
    shard = root / ITER / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    _refused(root, "truncated")


def test_pickles_naming_other_classes_are_refused(fixtures, tmp_path):
    root = _copy(fixtures, "gpt2", "tp1_torch", tmp_path)
    rank = root / ITER / "mp_rank_00" / "model_optim_rng.pt"
    _rewrite(rank, lambda d: setattr(d["args"], "hook", argparse.ArgumentParser))
    _refused(root, "refers to argparse.ArgumentParser")


def test_exports_load_in_megatron_core(fixtures):
    """tools/convert_megatron.py export at TP2 and PP2, both formats: megatron-core's own
    dist_checkpointing.load / torch.load + strict load_state_dict give the tensors of the original
    (tests/megatron_fixtures.py check_exports)."""
    from megatron_fixtures import export_name, exports

    for family in ("gpt2", "llama", "moe"):
        with open(os.path.join(fixtures, family, "export_check.json")) as f:
            report = json.load(f)
        assert report == {export_name(*case): [] for case in exports(family)}, family


def test_export_round_trip_is_bit_exact(fixtures):
    from megatron_fixtures import export_name, exports

    from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state

    for family in ("gpt2", "llama", "moe"):
        ours, meta = read_full_state(checkpoint_path(os.path.join(fixtures, family, "ours")))
        for case in exports(family):
            state, cfg, ckpt = read_model(os.path.join(fixtures, family, export_name(*case)))
            assert sorted(state) == sorted(ours) and all(torch.equal(state[k], ours[k]) for k in ours), case
            assert ckpt.args.tensor_model_parallel_size == case[1] and cfg.vocab_size == 100
            assert ckpt.args.expert_model_parallel_size == case[3]
    assert any(".experts.local_experts.3." in k for k in ours) and any(k.endswith("expert_bias") for k in ours)


def test_convert_tool_refuses_in_one_sentence(fixtures, tmp_path, capsys):
    from tools import convert_megatron

    assert convert_megatron.main(["--load", str(tmp_path / "none"), "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_megatron.py: error:") and "\n" not in err
    ours = os.path.join(fixtures, "llama", "ours")
    argv = ["export", "--load", ours, "--save", str(tmp_path / "e"), "--format", "torch"]
    assert convert_megatron.main(argv + ["--tensor-model-parallel-size", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def _pretrain(argv, capsys):
    from megatron_sp.training import pretrain

    code = pretrain.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_pretrain_continues_a_megatron_run(fixtures, tmp_path, capsys):
    """--load <Megatron-LM dir>: the weights, iteration 10 and 320 samples consumed; the schedule
    and the model flags checked against the checkpoint's; the optimizer only with --no-load-optim."""
    from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state
    from megatron_sp.training.config_flags import model_flags

    load = os.path.join(fixtures, "llama", "tp2_torch")
    imported, cfg, _ = read_model(load)
    run = ["--device", "cpu", "--seq-length", "16", "--micro-batch-size", "4", "--global-batch-size", "32"]
    run += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--no-progress-bar"]
    run += ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]
    run += ["--train-iters", "100"]
    run += ["--eval-iters", "0", "--exit-interval", "11", "--load", load] + model_flags(cfg)
    code, _, err = _pretrain(run, capsys)
    assert code == 2 and "--no-load-optim" in err and "\n" not in err
    assert "holding no optimizer state (--no-save-optim)" in err  # the fixture saves none: the layout named
    code, _, err = _pretrain(run + ["--no-load-optim", "--train-iters", "50"], capsys)
    assert code == 2 and "lr_decay_steps 3200" in err
    code, _, err = _pretrain(run + ["--no-load-optim", "--rotary-base", "10000"], capsys)
    assert code == 2 and "rotary_base=20000.0" in err
    save = tmp_path / "continued"
    code, out, err = _pretrain(run + ["--no-load-optim", "--save", str(save), "--save-interval", "11"], capsys)
    assert code == 0, err
    assert "resuming at iteration 10, 320 samples consumed" in out
    state, meta = read_full_state(checkpoint_path(str(save)))
    assert meta["iteration"] == 11 and meta["train_state"]["consumed_train_samples"] == 352
    assert meta["opt_param_scheduler"]["num_steps"] == 352  # the schedule went on from Megatron-LM's position
    step = max((state[k] - imported[k]).abs().max().item() for k in imported)
    assert 0 < step < 1e-3  # one AdamW step (lr <= 3e-4) from the Megatron-LM weights


def test_pretrain_continues_a_megatron_moe_run(fixtures, tmp_path, capsys):
    """--load of megatron-core's MoE checkpoint at EP2 (legacy files): its experts and expert biases
    carried over, one step taken from them."""
    from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state
    from megatron_sp.training.config_flags import model_flags

    load = os.path.join(fixtures, "moe", "ep2_torch")
    imported, cfg, _ = read_model(load)
    run = ["--device", "cpu", "--seq-length", "16", "--micro-batch-size", "4", "--global-batch-size", "32"]
    run += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--no-progress-bar"]
    run += ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]
    run += ["--train-iters", "100", "--eval-iters", "0", "--exit-interval", "11", "--load", load]
    save = tmp_path / "continued"
    run += model_flags(cfg) + ["--no-load-optim", "--save", str(save), "--save-interval", "11"]
    code, out, err = _pretrain(run, capsys)
    assert code == 0, err
    assert "resuming at iteration 10, 320 samples consumed" in out
    state, meta = read_full_state(checkpoint_path(str(save)))
    assert meta["iteration"] == 11 and sorted(state) == sorted(imported)
    bias = [k for k in imported if k.endswith("expert_bias")]
    assert bias and all(0 < (state[k] - imported[k]).abs().max() <= 1e-3 + 1e-7 for k in bias)  # one update
    step = max((state[k] - imported[k]).abs().max().item() for k in imported if k not in bias)
    assert 0 < step < 1e-3


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_all_moe_layers_round_trip(tmp_path, fmt):
    """An MoE on every layer (--moe-layer-freq 1): megatron-core stacks its torch_dist entries on
    [L, E, ...] (not the per-layer keys of the fixture's mixed layers); written at EP2 and read back
    bit for bit, expert biases and sinks included."""
    from megatron_sp.checkpointing.megatron_export import write_megatron
    from megatron_sp.checkpointing.safe_dcp import read_metadata
    from megatron_sp.config import GPTConfig

    cfg = GPTConfig(
        model="llama",
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=100,
        seq_length=8,
        ffn_hidden_size=64,
        num_experts=4,
        moe_ffn_hidden_size=16,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=32,
        softmax_type="learnable",
    )
    model = ReferenceGPT(cfg)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_()
    ours = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("tokens_per_expert")}
    path = write_megatron(ours, cfg, str(tmp_path / "out"), fmt, tp=2, pp=1, ep=2)
    if fmt == "torch_dist":
        entry = read_metadata(path, allow_objects=True).state_dict_metadata
        assert tuple(entry["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (2, 4, 32, 32)
    else:
        assert sorted(os.listdir(path)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    state, back, _ = read_model(str(tmp_path / "out"))
    assert sorted(state) == sorted(ours) and all(torch.equal(state[k], ours[k]) for k in ours)
    assert (back.num_experts, back.moe_layer_freq, back.softmax_type) == (4, 1, "learnable")


def _continue_llama_adamw(fixtures, save, capsys, extra=(), run_dir="optim_dist"):
    """pretrain_gpt_sp.py --load of megatron-core's AdamW run (tests/megatron_fixtures.py
    make_optimizer_run) for one step; (exit code, stderr, our fp32 main weights after it or None)."""
    from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state
    from megatron_sp.training.config_flags import model_flags

    load = os.path.join(fixtures, "llama", run_dir)
    _, cfg, _ = read_model(load)
    run = ["--device", "cpu", "--seq-length", "16", "--micro-batch-size", "4", "--global-batch-size", "32"]
    run += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--no-progress-bar"]
    run += ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]
    run += ["--train-iters", "100", "--eval-iters", "0", "--exit-interval", "11", "--load", load]
    run += ["--save", str(save), "--save-interval", "11"] + model_flags(cfg) + list(extra)
    code, _, err = _pretrain(run, capsys)
    return code, err, (read_full_state(checkpoint_path(str(save)))[0] if code == 0 else None)


def test_pretrain_continues_megatron_cores_adamw(fixtures, tmp_path, capsys, monkeypatch):
    """--load of a run of megatron-core's own FP32Optimizer (ten AdamW steps; torch_dist's
    optimizer.state.exp_avg / exp_avg_sq.<model key> and common_step): our step 11 on the same samples
    gives megatron-core's own step 11 within 1e-5 (the update is ~3e-4); a fresh AdamW, or the moments
    of q and k swapped in one layer, do not."""
    from megatron_sp.checkpointing import megatron_optim

    before, _, _ = read_model(os.path.join(fixtures, "llama", "optim_dist"))
    after, _, _ = read_model(os.path.join(fixtures, "llama", "optim_next_dist"))
    code, err, _ = _continue_llama_adamw(fixtures, tmp_path / "betas", capsys)
    assert code == 2 and "betas (0.9, 0.95)" in err and "--adam-beta2 0.999" in err and "\n" not in err
    code, err, ours = _continue_llama_adamw(fixtures, tmp_path / "ours", capsys, ["--adam-beta2", "0.95"])
    assert code == 0, err
    diff = lambda state: max((state[k] - after[k]).abs().max().item() for k in after)  # noqa: E731
    assert min((after[k] - before[k]).abs().max().item() for k in after) > 1e-4  # every tensor moved
    assert diff(ours) < 1e-5
    _, _, fresh = _continue_llama_adamw(
        fixtures, tmp_path / "fresh", capsys, ["--adam-beta2", "0.95", "--no-load-optim"]
    )
    assert diff(fresh) > 1e-4

    def swapped(mcore, cfg, padded, path, parameters_only=False):  # a planted mistake: q and k of layer 0
        out = megatron_optim_to_ours(mcore, cfg, padded, path, parameters_only)
        if "exp_avg)" in path:
            qkv, d = out["layers.0.attn.qkv.weight"], cfg.kv_channels
            q, k = qkv[: 2 * d].clone(), qkv[4 * d : 6 * d].clone()
            qkv[: 2 * d], qkv[4 * d : 6 * d] = k, q
        return out

    megatron_optim_to_ours = megatron_optim.to_ours
    monkeypatch.setattr(megatron_optim, "to_ours", swapped)
    _, _, planted = _continue_llama_adamw(fixtures, tmp_path / "planted", capsys, ["--adam-beta2", "0.95"])
    assert diff(planted) > 1e-5


def test_megatron_adam_state_lands_per_parameter(fixtures):
    """The MoE run's AdamW state (dense, router, SequentialMLP experts on torch_dist's [E, ...] axis,
    shared expert and its gate, sinks, padded vocab): every moment of every parameter equals
    megatron-core's in-memory one (optim_state.pt, by its parameter name) through the weights' mapping,
    and lands in our optimizer as the parameter's."""
    from megatron_sp.checkpointing.megatron_model import _mcore_names, _tensor_to_ours
    from megatron_sp.checkpointing.megatron_optim import load_optimizer, optimizer_layout, read_optimizer
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.parallel_state import ParallelState

    root = os.path.join(fixtures, "moe", "optim_dist")
    _, cfg, ckpt = read_model(root)
    assert optimizer_layout(ckpt.common, ckpt.path).readable
    adam = read_optimizer(ckpt.path, cfg, 128, ckpt.common)
    reference = torch.load(os.path.join(fixtures, "moe", "optim_state.pt"))
    names = {ours: mcore for ours, mcore in _mcore_names(cfg).items() if not ours.endswith("expert_bias")}
    assert sorted(adam.exp_avg) == sorted(names) and len(reference) == len(names) and adam.main is None
    for ours, mcore in names.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            expected = _tensor_to_ours(mcore, reference[mcore][kind], cfg, 128, root)
            assert torch.equal(getattr(adam, kind)[ours], expected), (ours, kind)
        assert reference[mcore]["step"].item() == adam.step == 10
    assert any(".local_experts.3." in k for k in names) and all(adam.exp_avg_sq[k].min() >= 0 for k in names)
    assert len({round(adam.exp_avg[k].abs().sum().item(), 6) for k in names}) == len(names)  # distinct, nonzero
    model = GPTModel(cfg, ParallelState())
    args = argparse.Namespace(lr=1e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01)
    optimizer = build_optimizer(model, args, "cpu")
    load_optimizer(adam, optimizer, model)
    mains = optimizer.main_params()
    for ours in names:  # (our embedding and output layer pad the vocab too: those rows start at zero)
        st, rows = optimizer.optim.state[mains[ours]], adam.exp_avg[ours].shape[0]
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[kind][:rows], getattr(adam, kind)[ours]) and not st[kind][rows:].any(), ours
        assert st["step"].item() == 10


def test_pretrain_continues_megatron_cores_bf16_adamw(fixtures, tmp_path, capsys):
    """--bf16: megatron-core's Float16OptimizerWithFloat16Params run (bf16 weights; fp32 main weights
    as optimizer.state.fp32_param.<model key>): our fp32 main weights after step 11 are megatron-core's
    within 2e-5 (bf16 compute on both sides; measured 5.5e-6, the update ~3e-4); a fresh AdamW, which
    also starts its main weights from the bf16 ones, is 2.9e-3 off."""
    from megatron_sp.checkpointing.megatron_optim import read_optimizer

    _, cfg, ckpt = read_model(os.path.join(fixtures, "llama", "optim_bf16_next_dist"))
    after = read_optimizer(ckpt.path, cfg, 128, ckpt.common).main
    run = ["--adam-beta2", "0.95", "--bf16"]
    code, err, ours = _continue_llama_adamw(fixtures, tmp_path / "ours", capsys, run, "optim_bf16_dist")
    assert code == 0, err
    diff = lambda state: max((state[k] - after[k]).abs().max().item() for k in after)  # noqa: E731
    assert diff(ours) < 2e-5
    _, _, fresh = _continue_llama_adamw(fixtures, tmp_path / "f", capsys, run + ["--no-load-optim"], "optim_bf16_dist")
    assert diff(fresh) > 1e-3


def test_pretrain_continues_megatron_cores_distributed_optimizer(fixtures, tmp_path, capsys):
    """megatron-core's DistributedOptimizer (inside its DistributedDataParallel, at TP2) saved with
    --dist-ckpt-optim-fully-reshardable: our TP1 step 11 is its step 11 within 1e-5; its default
    dp_reshardable layout (flat buckets) is refused in one sentence naming it without --no-load-optim."""
    _, _, ckpt = read_model(os.path.join(fixtures, "llama", "distopt_dist"))
    assert ckpt.common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    after, _, _ = read_model(os.path.join(fixtures, "llama", "distopt_next_dist"))
    code, err, ours = _continue_llama_adamw(
        fixtures, tmp_path / "ours", capsys, ["--adam-beta2", "0.95"], "distopt_dist"
    )
    assert code == 0, err
    assert max((ours[k] - after[k]).abs().max().item() for k in after) < 1e-5
    code, err, _ = _continue_llama_adamw(
        fixtures, tmp_path / "flat", capsys, ["--adam-beta2", "0.95"], "distopt_dp_reshardable_dist"
    )
    assert code == 2 and "(optimizer.distributed.*: dp_reshardable)" in err and "--no-load-optim" in err
    assert "\n" not in err
