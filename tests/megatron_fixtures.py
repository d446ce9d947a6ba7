"""Megatron-LM checkpoints written by megatron-core itself, for tests/test_megatron_checkpoints.py.

    python tests/megatron_fixtures.py OUT      # two gloo ranks on CPU; writes OUT/<family>/...

For each family (GPT-2-style: LayerNorm, biases, learned positions, gelu, tied output; Llama-style:
RMSNorm, SwiGLU, RoPE, GQA, qk-layernorm, untied) megatron-core's own GPTModel (the local spec) is
built at TP1, every parameter perturbed (norm weights off 1, biases off 0), its logits on a fixed
batch kept, and it is saved as Megatron-LM's `save_checkpoint` saves it (the state dict of
megatron/training/checkpointing.py's `generate_state_dict`):

    <family>/tp1_dist, tp2_dist, pp2_dist    --ckpt-format torch_dist (dist_checkpointing.save)
    <family>/tp1_torch, tp2_torch, pp2_torch --ckpt-format torch (mp_rank_TT[_PPP]/model_optim_rng.pt)
    llama/tp2_dist_head                      torch_dist without common.pt (Megatron-LM's main branch)
    <family>/logits.pt                       {"tokens": [b, s], "logits": [b, s, padded vocab]}

TP2 and PP2 models load the TP1 torch_dist checkpoint with megatron-core's own dist_checkpointing.load
(its resharding) before they are saved, so every layout holds the same weights.

megatron-core's save path assumes CUDA; the shims below (`cpu_shims`) make it run on CPU: a no-op
torch.cuda.synchronize, "cpu" as the current device, tensors staying on CPU, no psutil memory probe, and no CUDA RNG
tracker in the forward (dropout is off).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

ITERATION = 10
CONSUMED = 320  # samples: 32 per iteration
VOCAB, PADDED = 100, 128  # --vocab-size 100, --make-vocab-size-divisible-by 64: 128 at TP1 and TP2
SEQ = 16
FAMILIES = {
    "gpt2": dict(
        normalization="LayerNorm",
        add_bias_linear=True,
        add_qkv_bias=True,
        swiglu=False,
        position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False,
        num_query_groups=4,
        group_query_attention=False,
        ffn_hidden_size=256,
        qk_layernorm=False,
        rotary_base=10000,
    ),
    "llama": dict(
        normalization="RMSNorm",
        add_bias_linear=False,
        add_qkv_bias=False,
        swiglu=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
        group_query_attention=True,
        ffn_hidden_size=128,
        qk_layernorm=True,
        rotary_base=20000,
    ),
}


def cpu_shims() -> None:
    """What megatron-core 0.16.1's dist_checkpointing needs to save and load on a CPU-only torch."""
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the tied embedding's PP all-reduce
    filesystem_async._process_memory = lambda: 0
    tensor_parallel.get_cuda_rng_tracker = _NoRNGTracker  # the forward, no dropout: nothing to fork


class _NoRNGTracker:
    def fork(self, *args, **kwargs):
        import contextlib

        return contextlib.nullcontext()


def megatron_args(family: str, tp: int, pp: int) -> argparse.Namespace:
    """The training arguments Megatron-LM pickles into a checkpoint (the ones a reader needs, under
    megatron/training/arguments.py's names, and a few it does not)."""
    from megatron.core.transformer.enums import AttnBackend

    f = FAMILIES[family]
    return argparse.Namespace(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        kv_channels=16,
        max_position_embeddings=SEQ,
        seq_length=SEQ,
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        make_vocab_size_divisible_by=64,
        layernorm_epsilon=1e-5,
        layernorm_zero_centered_gamma=False,
        rotary_percent=1.0,
        rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=False,
        openai_gelu=False,
        squared_relu=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        num_experts=None,
        sequence_parallel=False,  # torch's norms in the local spec refuse it; it changes no tensor
        params_dtype=torch.float32,
        attention_backend=AttnBackend.local,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        seed=1234,
        micro_batch_size=4,
        global_batch_size=32,
        lr=3e-4,
        min_lr=3e-5,
        lr_decay_style="cosine",
        lr_warmup_iters=2,
        train_iters=100,
        use_distributed_optimizer=True,
        ckpt_format="torch",
        iteration=ITERATION,
        consumed_train_samples=CONSUMED,
        **{k: v for k, v in f.items()},
    )


def build_model(family: str, pre_process: bool = True, post_process: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = FAMILIES[family]
    swiglu = f["swiglu"]
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=f["num_query_groups"],
        kv_channels=16,
        ffn_hidden_size=f["ffn_hidden_size"],
        normalization=f["normalization"],
        layernorm_epsilon=1e-5,
        add_bias_linear=f["add_bias_linear"],
        add_qkv_bias=f["add_qkv_bias"],
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        bias_activation_fusion=False,
        qk_layernorm=f["qk_layernorm"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=_tp_size(),
        pipeline_model_parallel_size=_pp_size(),
        pipeline_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(normalization=f["normalization"], qk_layernorm=f["qk_layernorm"])
    return GPTModel(
        cfg,
        spec,
        vocab_size=PADDED,
        max_sequence_length=SEQ,
        position_embedding_type=f["position_embedding_type"],
        rotary_base=f["rotary_base"],
        share_embeddings_and_output_weights=not f["untie_embeddings_and_output_weights"],
        pre_process=pre_process,
        post_process=post_process,
    )


def _tp_size():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def _pp_size():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def perturb(model) -> None:
    """Every parameter moved off its initial value, so that a loader ignoring one is seen."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def state_dict(args, model, family: str) -> dict:
    """Megatron-LM's generate_state_dict (one model chunk), with its optimizer-scheduler state."""
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model,
        "opt_param_scheduler": {
            "max_lr": 3e-4,
            "min_lr": 3e-5,
            "lr_warmup_steps": 64,
            "num_steps": CONSUMED,
            "lr_decay_steps": 3200,
            "lr_decay_style": "cosine",
        },
        "num_floating_point_operations_so_far": 1.5e12,
    }


def save_torch(root: str, family: str, model, tp: int, pp: int) -> None:
    """--ckpt-format torch: each DP-rank-0 rank writes its own file."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() == 0:
        name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        if pp > 1:
            name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
        path = os.path.join(root, f"iter_{ITERATION:07d}", name)
        os.makedirs(path, exist_ok=True)
        args = megatron_args(family, tp, pp)
        sd = state_dict(args, model.state_dict_for_save_checkpoint(), family)
        torch.save(sd, os.path.join(path, "model_optim_rng.pt"))
    _finish(root)


def save_dist(root: str, family: str, model, tp: int, pp: int, head_style: bool = False) -> None:
    """--ckpt-format torch_dist; head_style: the common state inside the .distcp files as the
    "common_state" object, no common.pt (as Megatron-LM's main branch saves it)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    path = os.path.join(root, f"iter_{ITERATION:07d}")
    os.makedirs(path, exist_ok=True)
    args = megatron_args(family, tp, pp)
    args.ckpt_format = "torch_dist"
    sd = state_dict(args, model.sharded_state_dict(), family)
    if head_style:
        common = {k: sd.pop(k) for k in list(sd) if k != "model"}
        rank = torch.distributed.get_rank()
        sd["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=rank)
    dist_checkpointing.save(sd, path, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    if head_style and torch.distributed.get_rank() == 0:
        os.remove(os.path.join(path, "common.pt"))
    _finish(root)


def _finish(root: str) -> None:
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    torch.distributed.barrier()


def load_dist(model, path: str) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(loaded["model"])


def logits(model) -> dict:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(2, 1, SEQ, SEQ)  # True: masked
    with torch.no_grad():
        out = model.eval()(tokens, positions, mask)  # [b, s, padded vocab]
    return {"tokens": tokens, "logits": out}


def layout(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def make_family(out: str, family: str) -> None:
    from megatron.core import parallel_state as ps

    base = os.path.join(out, family)
    layout(1, 1)
    torch.manual_seed(1234)
    model = build_model(family)
    perturb(model)
    if torch.distributed.get_rank() == 0:
        os.makedirs(base, exist_ok=True)
        torch.save(logits(model), os.path.join(base, "logits.pt"))
    model.train()
    save_dist(os.path.join(base, "tp1_dist"), family, model, 1, 1)
    save_torch(os.path.join(base, "tp1_torch"), family, model, 1, 1)
    source = os.path.join(base, "tp1_dist", f"iter_{ITERATION:07d}")
    for tp, pp in ((2, 1), (1, 2)):
        layout(tp, pp)
        model = build_model(
            family, ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_pipeline_last_stage(ignore_virtual=True)
        )
        load_dist(model, source)
        name = f"tp{tp}" if pp == 1 else f"pp{pp}"
        save_dist(os.path.join(base, f"{name}_dist"), family, model, tp, pp)
        save_torch(os.path.join(base, f"{name}_torch"), family, model, tp, pp)
        if family == "llama" and tp == 2:
            save_dist(os.path.join(base, "tp2_dist_head"), family, model, tp, pp, head_style=True)


EXPORTS = (("torch_dist", 2, 1), ("torch", 2, 1), ("torch", 1, 2), ("torch_dist", 1, 2))


def export_name(fmt: str, tp: int, pp: int) -> str:
    return f"export_{fmt}_tp{tp}pp{pp}"


def convert_all(out: str) -> None:
    """Each family's TP1 torch_dist checkpoint through tools/convert_megatron.py into ours, and ours out
    again at each of EXPORTS (in a process of its own, without the fixture's process group)."""
    from tools import convert_megatron

    for family in FAMILIES:
        base = os.path.join(out, family)
        ours = os.path.join(base, "ours")
        assert convert_megatron.main(["--load", os.path.join(base, "tp1_dist"), "--save", ours]) == 0
        for fmt, tp, pp in EXPORTS:
            argv = ["export", "--load", ours, "--save", os.path.join(base, export_name(fmt, tp, pp))]
            argv += [
                "--format",
                fmt,
                "--tensor-model-parallel-size",
                str(tp),
                "--pipeline-model-parallel-size",
                str(pp),
            ]
            assert convert_megatron.main(argv) == 0


def check_exports(base: str, family: str) -> None:
    """megatron-core loads each export (dist_checkpointing.load of its sharded state dict, or
    torch.load of its rank's file and a strict load_state_dict) into the model of that layout; its
    tensors must equal those of the same model loaded from the original TP1 checkpoint (vocab rows
    beyond the tokenizer's 100: zeros). Writes base/export_check.json: {export: [mismatches]}."""
    import json

    from megatron.core import parallel_state as ps

    report = {}
    source = os.path.join(base, "tp1_dist", f"iter_{ITERATION:07d}")
    for fmt, tp, pp in EXPORTS:
        layout(tp, pp)
        stages = ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_pipeline_last_stage(ignore_virtual=True)
        exported, original = build_model(family, *stages), build_model(family, *stages)
        path = os.path.join(base, export_name(fmt, tp, pp), "iter_0000000")
        if fmt == "torch_dist":
            load_dist(exported, path)
        else:
            name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
            name += f"_{ps.get_pipeline_model_parallel_rank():03d}" if pp > 1 else ""
            exported.load_state_dict(torch.load(os.path.join(path, name, "model_optim_rng.pt"))["model"], strict=True)
        load_dist(original, source)
        mismatches = _compare(exported.state_dict(), original.state_dict(), tp)
        views = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(views, mismatches)
        report[export_name(fmt, tp, pp)] = sorted({m for view in views for m in view})
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(base, "export_check.json"), "w") as f:
            json.dump(report, f)


def _compare(exported: dict, original: dict, tp: int) -> list:
    """Names whose tensors differ (this rank's shards)."""
    from megatron.core import parallel_state as ps

    bad = sorted(set(exported) ^ set(original))
    for name, t in original.items():
        if not torch.is_tensor(t) or name in bad:
            continue
        e = exported[name]
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):  # this rank's vocab rows
            real = max(0, min(t.shape[0], VOCAB - ps.get_tensor_model_parallel_rank() * t.shape[0]))
            ok = torch.equal(e[:real], t[:real]) and not e[real:].any()
        else:
            ok = torch.equal(e, t)
        if not ok:
            bad.append(name)
    return bad


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    cpu_shims()
    for family in FAMILIES:
        make_family(out, family)
    if rank == 0:
        import subprocess

        done = subprocess.run([sys.executable, __file__, "--convert", out], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    torch.distributed.barrier()
    for family in FAMILIES:
        check_exports(os.path.join(out, family), family)
    torch.distributed.destroy_process_group()


def main(argv) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(argv[0], port), nprocs=2, start_method="fork")


if __name__ == "__main__":
    if sys.argv[1] == "--convert":
        convert_all(sys.argv[2])
    else:
        main(sys.argv[1:])
