"""pretrain_gpt_sp.py's body: parse and check everything cheap first, then start the world, build the
data, model and optimizer, and train.

Order matters for users: every error they can cause (flags, sizes, missing or bad data, tokenizer,
the checkpoint to load, the directory to save to) is found before any dataset index or model is
built, and reported in one sentence by the rank that found it (failures.py says who prints what).
Exit codes: 0 done or stopped by a signal after saving, 1 a fault while running, 2 bad input.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch

from megatron_sp import checkpointing, failures, parallel_state
from megatron_sp.checkpointing import megatron_resume
from megatron_sp.config import GPTConfig
from megatron_sp.data.errors import DataError
from megatron_sp.distributed.grad_sync import OverlappedGradSync
from megatron_sp.distributed.loss_scale import SkippedSteps, build_loss_scaler
from megatron_sp.distributed.optimizer import build_optimizer
from megatron_sp.training import trainer_report
from megatron_sp.training.arguments import ArgumentError, parse_args
from megatron_sp.training.config_flags import config_kwargs, in_flags
from megatron_sp.training.logger import TrainingLogger
from megatron_sp.training.loop import GradientUnderflowError, NonFiniteError, evaluate, train_step
from megatron_sp.training.memory import MemoryShortage, check_fits, describe_out_of_memory, is_out_of_memory
from megatron_sp.training.runtime import Runtime
from megatron_sp.training.schedules import LRSchedule, ParamScheduler, WDSchedule
from megatron_sp.training.throughput import peak_tflops

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Setup:
    """Everything checked before the heavy work starts."""

    args: object
    cfg: GPTConfig
    tokenizer: object
    prefixes: list


def parse_inputs(argv):
    """The command line, validated, with the device, backend and cache defaults filled in."""
    from megatron_sp.training.dist_env import detect_env

    args = parse_args(argv, world_size=detect_env().world_size)  # torchrun's or Slurm's variables
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda was asked for but no CUDA device is available; use --device cpu.")
    if args.torch_compile:
        from megatron_sp.models.compile import compile_problem

        problem = compile_problem(args.use_fused_kernels, args.device, args.tp_comm_overlap)
        if problem:
            raise ArgumentError(problem)
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.device == "cuda" else "gloo"
    if args.data_cache_path is None:
        args.data_cache_path = os.path.join(REPO, "data_cache")
    return args


def check_inputs(argv) -> Setup:
    """Flags, model sizes, tokenizer, data files, --load and --save: all validated before any heavy work.

    argv: the command line, or a namespace from parse_inputs.
    """
    from megatron_sp.data import build_tokenizer

    args = argv if hasattr(argv, "world_size") else parse_inputs(argv)
    tokenizer = build_tokenizer(
        args.tokenizer_type,
        args.tokenizer_model,
        args.vocab_size,
        args.vocab_file,
        args.merge_file,
        args.null_tokenizer_eod_id,
    )
    cfg = build_config(args, tokenizer.vocab_size)
    if args.use_torch_fsdp2:
        from megatron_sp.distributed.fsdp import model_problem

        if model_problem(cfg, args.pipeline_layout):
            raise ValueError(model_problem(cfg, args.pipeline_layout))
    prefixes = []
    if args.data_path:  # (imported here: --mock-data runs need neither numpy nor megatron-core)
        from megatron_sp.data import check_train_split, parse_data_path, validate_indexed_prefix

        prefixes, _ = parse_data_path(args.data_path)
        for prefix in prefixes:
            check_train_split(validate_indexed_prefix(prefix, vocab_size=tokenizer.vocab_size), args.split)
    if megatron_resume.is_megatron_dir(args.load):  # a Megatron-LM run's --save directory
        megatron_resume.check_resume(args.load, cfg, args)
        checkpointing.check_inputs(None, args.save, cfg)
    else:
        checkpointing.check_inputs(args.load, args.save, cfg)
    check_fits(cfg, args)
    return Setup(args, cfg, tokenizer, prefixes)


def build_config(args, vocab_size: int) -> GPTConfig:
    """The model the command line describes (every GPTConfig field with flags, and the parameters'
    dtype from --bf16 / --fp16; see config.py). Its errors name the flags, not the fields."""
    try:
        return GPTConfig(vocab_size=vocab_size, params_dtype=args.params_dtype, **config_kwargs(args))
    except ValueError as err:
        raise ValueError(in_flags(str(err))) from None


def build_data(setup: Setup, ps):
    """Train/valid datasets (megatron-core GPTDataset over .bin/.idx, or the embedded corpus)."""
    args = setup.args
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters if evaluates(args) else 0
    train_samples = args.batch_schedule.samples(args.train_iters)
    if args.mock_data:
        from megatron_sp.data.mock import MockGPTDataset

        return (
            MockGPTDataset(train_samples, args.seq_length, setup.cfg.vocab_size, args.seed),
            MockGPTDataset(
                max(evals, 1) * args.global_batch_size, args.seq_length, setup.cfg.vocab_size, args.seed + 1
            ),
        )
    from megatron_sp.data import build_gpt_datasets

    with warnings.catch_warnings():  # the run never reads the test split: an empty one is fine
        warnings.filterwarnings("ignore", message="The test split")
        train, valid, _ = build_gpt_datasets(
            args.data_path or None,
            args.split,
            args.seq_length,
            args.seed,
            setup.tokenizer,
            train_samples=train_samples,
            valid_samples=max(evals, 1) * args.global_batch_size,
            test_samples=max(args.eval_iters, 1) * args.global_batch_size,
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask,
            eod_mask_loss=args.eod_mask_loss,
            cache_dir=args.data_cache_path,
        )
    return train, valid


def evaluates(args) -> bool:
    """Megatron-LM's rule: evaluation every --eval-interval, none without one or with --eval-iters 0."""
    return bool(args.eval_interval) and args.eval_iters > 0


def data_iterator(dataset, consumed: int, args, ps):
    from megatron_sp.data import build_data_iterator

    if dataset is None:
        return None
    return build_data_iterator(dataset, consumed, args.micro_batch_size, ps.dp_rank, ps.dp_size)


def main(argv=None, signals=None) -> int:
    """The program. signals: an installed ExitSignalHandler (pretrain_gpt_sp.py installs one before
    importing torch); without one, main installs its own for its duration."""
    from megatron_sp.training.signals import ExitSignalHandler

    own = signals is None
    if own:  # a SIGTERM/SIGUSR1/SIGINT during start-up is recorded, not fatal
        signals = ExitSignalHandler().install()
    try:
        return _main(argv, signals)
    finally:
        if own:
            signals.uninstall()


def _main(argv, signals) -> int:
    try:
        args = parse_inputs(argv)
    except ArgumentError as err:  # the command line: the same on every rank
        return failures.report_deterministic(err, 2)
    except ValueError as err:  # this rank's launcher environment (dist_env)
        failures.print_error(failures.one_sentence(err))
        return 2
    setup, input_error = None, None
    try:
        setup = check_inputs(args)
    except (DataError, checkpointing.CheckpointError, MemoryShortage) as err:  # what this rank sees: agreed below
        input_error = failures.one_sentence(err)
    except ValueError as err:  # GPTConfig's: the same on every rank
        return failures.report_deterministic(err, 2)
    from megatron_sp.training.dist_env import destroy_distributed, init_distributed

    try:
        init_distributed(args.distributed_backend, args.device, timeout_s=60 * args.distributed_timeout_minutes)
    except (ValueError, RuntimeError) as err:  # a wrong launch or a rendezvous that failed
        failures.print_error(failures.one_sentence(err))
        return 2 if isinstance(err, ValueError) else 1
    run_lock = None
    try:
        if (
            input_error is None
            and args.save
            and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
        ):
            run_lock, input_error = _lock_save_dir(args.save)
        failed = failures.agree(input_error)
        if failed:
            return failures.report_agreed(failed, 2)
        signals.device = args.device
        code = Trainer(setup).run(signals)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # nobody tears the group down while a peer still logs
        destroy_distributed(wait_for_peers=True)  # and the store's host leaves last (dist_env.py)
        return code
    except (NonFiniteError, GradientUnderflowError, checkpointing.CheckpointSaveError, OSError) as err:
        return failures.report_once(failures.one_sentence(err), 1)
    except (checkpointing.CheckpointError, DataError) as err:
        return failures.report_once(failures.one_sentence(err), 2)
    except (RuntimeError, MemoryError) as err:  # out of memory, a peer died or hung (else a bug: traceback)
        if is_out_of_memory(err):
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            return failures.report_once(describe_out_of_memory(err, setup.cfg, args, rank), 1)
        if not failures.is_collective_failure(err):
            raise
        words = failures.describe_collective_failure(
            err, args.distributed_timeout_minutes, args.pipeline_model_parallel_size
        )
        return failures.report_once(words, 1)
    finally:
        destroy_distributed()
        if run_lock is not None:
            run_lock.release()


def _lock_save_dir(root):
    """(rank 0's lock on --save, or None; the one sentence that refuses the run, or None)."""
    from megatron_sp.checkpointing.locks import RunLock, SaveDirInUse

    lock = RunLock(root)
    try:
        note = lock.acquire()
    except SaveDirInUse as err:
        return None, str(err) + "."
    except OSError as err:
        return None, f"--save {root}: its lock file cannot be opened ({err.strerror or err})."
    if note:
        print(note, flush=True)
    return lock, None


def build_scheduler(args, log=print) -> ParamScheduler:
    """The LR and weight-decay schedules of the command line (spans in samples: argument_checks.py)."""
    lr = LRSchedule(
        args.lr,
        args.min_lr,
        args.lr_warmup_steps,
        args.lr_decay_steps,
        args.lr_decay_style,
        init=args.lr_warmup_init,
        wsd_decay=args.wsd_decay_steps,
        wsd_style=args.lr_wsd_decay_style,
    )
    wd = WDSchedule(args.start_weight_decay, args.end_weight_decay, args.wd_incr_steps, args.weight_decay_incr_style)
    decoupled = None
    if args.decoupled_lr is not None:  # Megatron-LM: the embedding and output layer's own LR
        decoupled = (args.decoupled_lr, args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr)
    return ParamScheduler(
        lr,
        wd,
        decoupled,
        use_checkpoint=args.use_checkpoint_opt_param_scheduler,
        override=args.override_opt_param_scheduler,
        log=log,
    )


def build_model(cfg, args, ps):
    """GPTModel, or this rank's pipeline stages (PipelineGPT) with --pipeline-model-parallel-size > 1."""
    if ps.pp_size > 1:
        from megatron_sp.pipeline_parallel.model import PipelineGPT

        return PipelineGPT(cfg, args.pipeline_layout, ps, device=args.device)
    from megatron_sp.models.gpt import GPTModel

    return GPTModel(cfg, ps, device=args.device)


class Trainer:
    """Holds the run's state; `run()` trains until --train-iters, --exit-interval or a signal."""

    def __init__(self, setup: Setup):
        self.args, self.cfg = setup.args, setup.cfg
        args = self.args
        torch.manual_seed(args.seed)
        self.ps = parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.context_parallel_size,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),  # the world's (init_distributed)
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            hierarchical_context_parallel_sizes=self.cfg.hierarchical_context_parallel_sizes,
            expert_model_parallel_size=self.cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=self.cfg.expert_tensor_parallel_size,
        )
        self.log = TrainingLogger(
            args, enabled=torch.distributed.get_rank() == 0 if torch.distributed.is_initialized() else True
        )
        self.model = build_model(self.cfg, args, self.ps)  # (on meta, then this rank's shards)
        if args.torch_compile:  # each layer compiles at its first call; parameter names are unchanged
            from megatron_sp.models.compile import compile_layers

            compile_layers(self.model)
        if args.use_torch_fsdp2:  # ZeRO-3: FSDP2 owns the gradients and their reduction
            from megatron_sp.distributed.fsdp import build_fsdp_optimizer

            self.optimizer = build_fsdp_optimizer(self.model, args, args.device, self.ps)
        else:
            self.optimizer = build_optimizer(self.model, args, args.device, self.ps)
        self.scaler = build_loss_scaler(args)
        self.skipped = SkippedSteps(args.loss_scale_window)
        self.grad_sync = (
            OverlappedGradSync(self.optimizer.grad_buffers, self.ps, partition=self.optimizer.partition)
            if args.overlap_grad_reduce and self.ps.replicas > 1 and not args.use_torch_fsdp2
            else None
        )
        self.scheduler = build_scheduler(args, self.log.info)
        self.runtime = Runtime(args, self.ps)
        self.state = checkpointing.TrainState()
        if args.load:
            self._load()
        self.optimizer.cast_fp8_weights()  # (--fp8-param-gather: from the main weights, loaded or not)
        self.scheduler.apply(self.optimizer)  # the rates of the first update (Megatron's step(0))
        self.train_ds, self.valid_ds = build_data(setup, self.ps)
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        self.peak, self.peak_source = peak_tflops(args.device, precision, args.peak_tflops)

    def _checkpoint_states(self) -> dict:
        """What a checkpoint of this run holds (megatron_sp/checkpointing/states.py)."""
        if self.args.use_torch_fsdp2:  # the same canonical entries, gathered from the FSDP2 shards
            from megatron_sp.distributed.fsdp_checkpoint import checkpoint_states

            tensors = checkpoint_states(self.model, self.optimizer, self.ps)
        else:
            tensors = {
                "model": checkpointing.ModelState(self.model, self.ps, self.optimizer.main_params()),
                "optim": checkpointing.OptimizerState(
                    self.optimizer.optim, self.model, self.ps, self.optimizer.main_params()
                ),
            }
        return {
            **tensors,
            "train_state": self.state,
            "opt_param_scheduler": self.scheduler,  # Megatron's key and fields
            "loss_scale": self.scaler,  # None without --fp16
            "rng": checkpointing.RNGState(),
            **(
                {"fp8": checkpointing.Fp8ScalingState(self.model)}
                if self.cfg.fp8 is not None and self.cfg.fp8_recipe == "delayed"
                else {}
            ),
        }

    def _save(self):
        """--save: everything, less the optimizer or the RNG state with --no-save-optim / --no-save-rng
        (a resume then starts them fresh, as after --no-load-optim / --no-load-rng). As in Megatron-LM
        the LR schedule goes with the optimizer: --no-save-optim records it as null."""
        a = self.args
        skip = {"optim"} if a.no_save_optim else set()
        skip |= {"rng"} if a.no_save_rng else set()
        states = {k: v for k, v in self._checkpoint_states().items() if k not in skip}
        if a.no_save_optim:
            states["opt_param_scheduler"] = None
        checkpointing.save(
            a.save,
            states,
            self.cfg,
            self.ps,
            log=self.log.info,
            async_save=a.async_save,
            retain_interval=a.save_retain_interval,
        )

    def _load(self):
        """--load: everything (weights only with --finetune, less the optimizer or the RNG state with
        --no-load-optim / --no-load-rng). None to load starts from scratch only when --load is also
        --save, and never with --exit-on-missing-checkpoint."""
        args = self.args
        if megatron_resume.is_megatron_dir(args.load):
            load_optim = not (args.finetune or args.no_load_optim)
            it = megatron_resume.load_resume(
                args.load, self.cfg, self.model, self.optimizer, self.state, args.finetune, self.scheduler, load_optim
            )
            self.log.info(
                f" loaded Megatron-LM checkpoint {args.load} (iteration {it}; weights"
                f"{'' if args.finetune else ', iteration, data position and LR schedule'}"
                f"{', AdamW state' if load_optim else ''}; fresh {'' if load_optim else 'AdamW and '}RNG state)"
            )
            return
        skip = {"optim", "opt_param_scheduler", "train_state", "loss_scale", "rng", "fp8"} if args.finetune else set()
        skip |= {"optim", "opt_param_scheduler"} if args.no_load_optim else set()  # (Megatron's)
        skip |= {"rng"} if args.no_load_rng else set()
        states = {k: v for k, v in self._checkpoint_states().items() if k not in skip}
        is_save_dir = checkpointing.same_path(args.load, args.save) and not args.exit_on_missing_checkpoint
        meta = checkpointing.load(
            args.load,
            states,
            self.cfg,
            is_save_dir=is_save_dir,
            log=self.log.info,
            strictness=args.dist_ckpt_strictness,
        )
        if meta is not None and "opt_param_scheduler" in states and "opt_param_scheduler" not in meta:
            self.scheduler.num_steps = self.state.consumed_train_samples  # (saved before the schedule was)
        if meta is not None:
            self.log.info(
                f" loaded checkpoint {checkpointing.checkpoint_dir(args.load, meta['iteration'])} (saved at "
                f"TP={meta['tensor_model_parallel_size']}"
                f"{f', PP={pp}' if (pp := meta.get('pipeline_model_parallel_size', 1)) > 1 else ''}, "
                f"iteration {meta['iteration']})"
                f"{' for finetuning' if args.finetune else ''}"
            )

    def run(self, signals=None) -> int:
        """Trains from the current state; returns 0. signals: an installed ExitSignalHandler."""
        from megatron_sp.training.signals import ExitSignalHandler, write_exit_status

        args, state = self.args, self.state
        own = signals is None
        if own:
            signals = ExitSignalHandler(args.device).install()
        trainer_report.describe(self)
        train_iter = data_iterator(self.train_ds, state.consumed_train_samples, args, self.ps)
        self.valid_iter = data_iterator(self.valid_ds, state.consumed_valid_samples, args, self.ps)
        self.log.start_at(state.iteration)
        if signals.should_exit():  # got one during start-up: nothing new to save
            got = getattr(signals.received_signal, "name", "on another rank")
            self.log.info(f" exit signal ({got}) received before training: exiting at iteration {state.iteration}")
        elif state.iteration >= args.train_iters:
            self.log.info(
                f" training already finished (iteration {state.iteration}, --train-iters "
                f"{args.train_iters}): nothing to do"
            )
        else:
            self._train_loop(train_iter, signals)
            if self.skipped.summary():
                self.log.warning(self.skipped.summary())
        self.runtime.close()
        checkpointing.wait_for_saves()
        write_exit_status(finished=state.iteration >= args.train_iters, iteration=state.iteration)
        if own:
            signals.uninstall()
        self.log.close()
        return 0

    def _train_loop(self, train_iter, signals):
        args, state = self.args, self.state
        while state.iteration < args.train_iters:
            self._train_one(train_iter)
            if evaluates(args) and state.iteration % args.eval_interval == 0:
                self._evaluate()
            if args.save and args.save_interval and state.iteration % args.save_interval == 0:
                self._save()
            if signals.should_exit():
                self.log.info(f" exit signal received: saving at iteration {state.iteration} and exiting")
                if args.save:
                    self._save()
                return
            if self.runtime.out_of_time():
                self.log.info(
                    f" exiting at iteration {state.iteration}: --exit-duration-in-mins {args.exit_duration_in_mins} "
                    f"would be passed by the next steps{' (saved)' if args.save else ''}"
                )
                if args.save:
                    self._save()
                return
            if args.exit_interval and state.iteration % args.exit_interval == 0:
                if args.save:
                    self._save()
                self.log.info(f" exiting at iteration {state.iteration} (--exit-interval {args.exit_interval})")
                return
        if args.save and (not args.save_interval or state.iteration % args.save_interval != 0):
            self._save()

    def _train_one(self, train_iter):
        args, state = self.args, self.state
        batch = args.batch_schedule.at(state.consumed_train_samples)
        self.runtime.before_step(state.iteration + 1)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = train_step(
            self.model,
            self.optimizer,
            train_iter,
            batch // (args.micro_batch_size * args.data_parallel_size),
            self.ps,
            device=args.device,
            clip_grad=args.clip_grad,
            iteration=state.iteration + 1,
            scaler=self.scaler,
            grad_sync=self.grad_sync,
            per_token_loss=args.calculate_per_token_loss,
            empty_cache=args.empty_unused_memory_level >= 2,
            moe_per_layer=args.moe_per_layer_logging,
        )
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if result.underflow:
            self.log.info(
                f" iteration {state.iteration + 1}: the fp16 gradients underflowed to zero; step skipped, "
                f"loss scale raised to {self.scaler.scale:.3g}"
            )
        if not result.skipped:  # Megatron's: only a successful update advances the schedule
            self.scheduler.step(batch, self.optimizer)
        state.iteration += 1
        state.consumed_train_samples += batch
        if self.scaler is not None:
            warning = self.skipped.count(result.skipped, state.iteration, self.scaler.scale)
            if warning:
                self.log.warning(warning)
        self.log.step(trainer_report.record(self, result, batch, elapsed))
        self.runtime.after_step(state.iteration)
        if args.async_save:
            checkpointing.finalize_async_save()  # the one in flight, once every rank has written it

    def _evaluate(self):
        if self.valid_iter is None:
            return
        args = self.args
        loss = evaluate(
            self.model,
            self.valid_iter,
            args.eval_iters,
            args.num_micro_batches,
            self.ps,
            device=args.device,
            per_token_loss=args.calculate_per_token_loss,
        )
        if args.use_torch_fsdp2:  # the root's weights stay gathered after a forward without backward
            from megatron_sp.distributed.fsdp import reshard

            reshard(self.model)
        self.state.consumed_valid_samples += args.eval_iters * args.global_batch_size
        self.log.evaluation(self.state.iteration, loss, math.exp(min(loss, 20.0)))
