"""pretrain_gpt_sp.py's body: parse and check everything cheap first, then start the world, build the
data, model and optimizer, and train.

Order matters for users: every error they can cause (flags, sizes, missing or bad data, tokenizer)
is reported in one sentence before any process group, dataset index or model is built.
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from megatron_sp import parallel_state
from megatron_sp.config import GPTConfig
from megatron_sp.training import checkpointing
from megatron_sp.training.arguments import ArgumentError, parse_args
from megatron_sp.training.grad_sync import OverlappedGradSync
from megatron_sp.training.logger import TrainingLogger
from megatron_sp.training.loop import NonFiniteError, evaluate, train_step
from megatron_sp.training.optimizer import DynamicLossScaler, build_optimizer
from megatron_sp.training.schedules import LRSchedule
from megatron_sp.training.throughput import peak_tflops, throughput

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Setup:
    """Everything checked before the heavy work starts."""

    args: object
    cfg: GPTConfig
    tokenizer: object
    prefixes: list


def _is_first_rank() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def check_inputs(argv) -> Setup:
    """Flags, model sizes, tokenizer and data files: all validated before any heavy work."""
    from megatron_sp.data import build_tokenizer
    from megatron_sp.training.dist_env import detect_env
    args = parse_args(argv, world_size=detect_env().world_size)   # torchrun's or Slurm's variables
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda was asked for but no CUDA device is available; use --device cpu.")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.device == "cuda" else "gloo"
    if args.data_cache_path is None:
        args.data_cache_path = os.path.join(REPO, "data_cache")
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    cfg = build_config(args, tokenizer.vocab_size)
    prefixes = []
    if args.data_path:   # (imported here: --mock-data runs need neither numpy nor megatron-core)
        from megatron_sp.data import parse_data_path, validate_indexed_prefix
        prefixes, _ = parse_data_path(args.data_path)
        for prefix in prefixes:
            validate_indexed_prefix(prefix, vocab_size=tokenizer.vocab_size)
    return Setup(args, cfg, tokenizer, prefixes)


def build_config(args, vocab_size: int) -> GPTConfig:
    return GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size, seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size,
        max_position_embeddings=args.max_position_embeddings, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std, seed=args.seed,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        use_fused_kernels=not args.no_fused_kernels)


def build_data(setup: Setup, ps):
    """Train/valid datasets (megatron-core GPTDataset over .bin/.idx, or the embedded corpus)."""
    args = setup.args
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    if args.mock_data:
        from megatron_sp.data.mock import MockGPTDataset
        return (MockGPTDataset(args.train_iters * args.global_batch_size, args.seq_length, setup.cfg.vocab_size,
                               args.seed),
                MockGPTDataset(evals * args.global_batch_size, args.seq_length, setup.cfg.vocab_size, args.seed + 1))
    from megatron_sp.data import build_gpt_datasets
    with warnings.catch_warnings():   # the run never reads the test split: an empty one is fine
        warnings.filterwarnings("ignore", message="The test split")
        train, valid, _ = build_gpt_datasets(
            args.data_path or None, args.split, args.seq_length, args.seed, setup.tokenizer,
            train_samples=args.train_iters * args.global_batch_size,
            valid_samples=evals * args.global_batch_size, test_samples=args.eval_iters * args.global_batch_size,
            reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
            eod_mask_loss=args.eod_mask_loss, cache_dir=args.data_cache_path)
    return train, valid


def data_iterator(dataset, consumed: int, args, ps):
    from megatron_sp.data import build_data_iterator
    if dataset is None:
        return None
    return build_data_iterator(dataset, consumed, args.micro_batch_size, ps.dp_rank, ps.dp_size)


def main(argv=None) -> int:
    try:
        setup = check_inputs(argv)
    except ValueError as err:          # ArgumentError, DataError, GPTConfig's ValueError
        if _is_first_rank():
            print(f"pretrain_gpt_sp.py: error: {err}", file=sys.stderr)
        return 2
    from megatron_sp.training.dist_env import destroy_distributed, init_distributed
    args = setup.args
    try:
        init_distributed(args.distributed_backend, args.device, timeout_s=60 * args.distributed_timeout_minutes)
    except (ValueError, RuntimeError) as err:    # a wrong launch or a rendezvous that failed
        print(f"pretrain_gpt_sp.py: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    try:
        code = Trainer(setup).run()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()   # nobody tears the group down while a peer still logs
        return code
    except NonFiniteError as err:
        print(f"pretrain_gpt_sp.py: error: {err}", file=sys.stderr)
        return 1
    except checkpointing.CheckpointError as err:
        print(f"pretrain_gpt_sp.py: error: {err}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()


class Trainer:
    """Holds the run's state; `run()` trains until --train-iters, --exit-interval or a signal."""

    def __init__(self, setup: Setup):
        self.args, self.cfg = setup.args, setup.cfg
        args = self.args
        torch.manual_seed(args.seed)
        self.ps = parallel_state.initialize_model_parallel(args.tensor_model_parallel_size)
        self.log = TrainingLogger(args, enabled=torch.distributed.get_rank() == 0
                                  if torch.distributed.is_initialized() else True)
        self.dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        from megatron_sp.models.gpt import GPTModel
        self.model = GPTModel(self.cfg, self.ps).to(args.device)
        self.optimizer = build_optimizer(self.model, args, args.device)
        self.scaler = DynamicLossScaler(args.initial_loss_scale) if args.fp16 else None
        self.grad_sync = (OverlappedGradSync(self.model, self.ps)
                          if args.overlap_grad_reduce and self.ps.dp_size > 1 else None)
        self.schedule = LRSchedule(args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
                                   args.lr_decay_style)
        self.state = checkpointing.TrainState()
        if args.load:
            checkpointing.load(args, self)
        self.train_ds, self.valid_ds = build_data(setup, self.ps)
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        self.peak, self.peak_source = peak_tflops(args.device, precision, args.peak_tflops)

    def run(self) -> int:
        args, state = self.args, self.state
        self._describe()
        train_iter = data_iterator(self.train_ds, state.consumed_train_samples, args, self.ps)
        self.valid_iter = data_iterator(self.valid_ds, state.consumed_valid_samples, args, self.ps)
        from megatron_sp.training.signals import ExitSignalHandler
        signals = ExitSignalHandler(args.device).install()
        self.log.start_at(state.iteration)
        exit_code = 0
        while state.iteration < args.train_iters:
            self._train_one(train_iter)
            if args.eval_interval and state.iteration % args.eval_interval == 0:
                self._evaluate()
            if args.save and args.save_interval and state.iteration % args.save_interval == 0:
                checkpointing.save(args, self)
            if signals.should_exit():
                self.log.info(f" exit signal received: saving at iteration {state.iteration} and exiting")
                if args.save:
                    checkpointing.save(args, self)
                exit_code = 0
                break
            if args.exit_interval and state.iteration % args.exit_interval == 0:
                if args.save:
                    checkpointing.save(args, self)
                self.log.info(f" exiting at iteration {state.iteration} (--exit-interval {args.exit_interval})")
                break
        else:
            if args.save and (not args.save_interval or state.iteration % args.save_interval != 0):
                checkpointing.save(args, self)
        signals.uninstall()
        self.log.close()
        return exit_code

    def _train_one(self, train_iter):
        args, state = self.args, self.state
        lr = self.schedule.apply(self.optimizer, state.iteration + 1)
        start = time.perf_counter()
        result = train_step(self.model, self.optimizer, train_iter, args.num_micro_batches, self.ps,
                            device=args.device, dtype=self.dtype, clip_grad=args.clip_grad,
                            iteration=state.iteration + 1, scaler=self.scaler, grad_sync=self.grad_sync)
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        state.iteration += 1
        state.consumed_train_samples += args.global_batch_size
        tokens = args.global_batch_size * args.seq_length
        record = {"iteration": state.iteration, "lm_loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                  "consumed_samples": state.consumed_train_samples, "global_batch_size": args.global_batch_size,
                  "elapsed_ms": 1000 * elapsed, "skipped": result.skipped, "peak_tflops": self.peak,
                  "loss_scale": self.scaler.scale if self.scaler else None,
                  **throughput(self.cfg.flops_per_token(), tokens, elapsed, args.world_size, self.peak)}
        self.log.step(record)

    def _evaluate(self):
        if self.valid_iter is None:
            return
        args = self.args
        loss = evaluate(self.model, self.valid_iter, args.eval_iters, args.num_micro_batches, self.ps,
                        device=args.device, dtype=self.dtype)
        self.state.consumed_valid_samples += args.eval_iters * args.global_batch_size
        self.log.evaluation(self.state.iteration, loss, math.exp(min(loss, 20.0)))

    def _describe(self):
        a, c = self.args, self.cfg
        self.log.info(
            f" megatron_sp: world {a.world_size} = TP {a.tensor_model_parallel_size} × DP {a.data_parallel_size}"
            f"{' + SP' if c.sequence_parallel else ''} | device {a.device} ({a.distributed_backend}) | "
            f"{c.num_parameters() / 1e6:.2f}M parameters | vocab {c.vocab_size} (padded {c.padded_vocab_size}) | "
            f"{a.num_micro_batches} micro-batches of {a.micro_batch_size} per DP rank | "
            f"MFU peak {self.peak:.3g} TFLOP/s ({self.peak_source})")
        if self.state.iteration:
            self.log.info(f" resuming at iteration {self.state.iteration}, "
                          f"{self.state.consumed_train_samples} samples consumed")
