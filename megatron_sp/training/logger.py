"""What a training run reports, on the first rank only: a Megatron-style line every log interval, a
progress bar when attached to a terminal (with tqdm), TensorBoard event files and Weights & Biases
(every --tensorboard-log-interval, under our names and Megatron-LM's), a JSON-lines file and a
loss-curve PNG at the end (with matplotlib; --loss-curve without it is refused at start-up). JSON numbers
are written at full float precision (parity checks read them)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time


class TrainingLogger:
    def __init__(self, args, enabled: bool):
        self.enabled, self.args = enabled, args
        self.records, self.eval_records = [], []
        self._skipped = 0  # steps skipped since the last printed line (Megatron's "number of skipped iterations")
        self._tb = self._jsonl = self._bar = self._wandb = None
        if not enabled:
            return
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
        if args.wandb_project:
            from megatron_sp.training.reporting import WandbWriter

            self._wandb = WandbWriter(args)
        if args.log_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(args.log_jsonl)), exist_ok=True)
            self._jsonl = open(args.log_jsonl, "a", buffering=1)
        if sys.stdout.isatty() and not args.no_progress_bar:
            try:
                from tqdm import tqdm
            except ImportError:  # no progress bar without tqdm; the log lines are unchanged
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=args.train_iters, desc="train", unit="it", dynamic_ncols=True)

    def info(self, message: str):
        if self.enabled:
            self._write(message)

    def warning(self, message: str):
        """A problem the run goes on with: on stderr, one sentence, as the errors are."""
        if self.enabled:
            print(f"pretrain_gpt_sp.py: warning: {message}", file=sys.stderr, flush=True)

    def _write(self, message: str):
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def start_at(self, iteration: int):
        if self._bar is not None:
            self._bar.n = iteration
            self._bar.refresh()

    def step(self, record: dict):
        """One training iteration's figures; printed/written every log interval, to TensorBoard and
        wandb every --tensorboard-log-interval."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['lm_loss']:.4f}")
        it = record["iteration"]
        if it % self.args.tensorboard_log_interval == 0:
            self._scalars(record, it)
        self._skipped += bool(record.get("skipped"))
        if it % self.args.log_interval != 0 and it not in (1, self.args.train_iters):
            return
        record, self._skipped = dict(record, skipped_iterations=self._skipped), 0  # since the last line
        self.records.append(record)
        self._write(_megatron_line(record, self.args.train_iters, self.args.timing_log_level))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")

    def _scalars(self, record: dict, it: int):
        values = {f"train/{k}": record.get(k) for k in _OURS}
        values.update({name: record.get(key) for name, key in _MEGATRON.items()})
        a = self.args
        if a.log_loss_scale_to_tensorboard:
            values["loss-scale"] = record.get("loss_scale")
        if a.log_world_size_to_tensorboard:
            values["world-size"] = a.world_size
        if a.log_throughput:
            values["throughput"] = record.get("tflops")
        if a.log_memory_to_tensorboard:
            values.update(record.get("memory") or {})
        if a.log_timers_to_tensorboard:
            values.update({f"{k}-time": v for k, v in (record.get("timers") or {}).items()})
        values.update({k: record.get(k) for k in MOE_LOSSES})  # Megatron's names
        values.update(record.get("moe_layers") or {})
        values = {k: v for k, v in values.items() if v is not None}
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, it)
        if self._wandb is not None:
            self._wandb.log(values, it)

    def evaluation(self, iteration: int, loss: float, ppl: float, split: str = "validation"):
        if not self.enabled:
            return
        self.eval_records.append({"iteration": iteration, "lm_loss": loss})
        self._write(f" {split} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E}")
        if self._jsonl is not None:
            self._jsonl.write(
                json.dumps({"iteration": iteration, f"{split}_lm_loss": loss, f"{split}_ppl": ppl}) + "\n"
            )
        values = {f"{split}/lm_loss": loss, f"lm loss {split}": loss}
        if self.args.log_validation_ppl_to_tensorboard:
            values.update({f"{split}/ppl": ppl, f"lm loss {split} ppl": ppl})
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, iteration)
        if self._wandb is not None:
            self._wandb.log(values, iteration)

    def close(self):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.close()
        path = self.loss_curve_path()
        if path and self.records:
            if importlib.util.find_spec("matplotlib") is None:  # only the implicit PNG gets here
                self._write(f" no loss curve at {path}: matplotlib is not installed")
            else:
                write_loss_curve(path, self.records, self.eval_records)
                self._write(f" loss curve written to {path}")

    def loss_curve_path(self):
        if self.args.loss_curve:
            return self.args.loss_curve
        if self.args.log_jsonl:
            return os.path.splitext(self.args.log_jsonl)[0] + "_loss.png"
        if self.args.tensorboard_dir:
            return os.path.join(self.args.tensorboard_dir, "loss_curve.png")
        return None


# TensorBoard / wandb scalars: ours (train/<record key>) and Megatron-LM's names (name -> record key).
MOE_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
_OURS = ("lm_loss", "lr", "grad_norm", "tokens_per_sec", "tflops", "mfu", "loss_scale")
_MEGATRON = {
    "lm loss": "lm_loss",
    "learning-rate": "lr",
    "decoupled-learning-rate": "decoupled_lr",
    "batch-size": "global_batch_size",
    "grad-norm": "grad_norm",
    "params-norm": "params_norm",
    "num-zeros": "num_zeros",
    "iteration-time": "elapsed_s",
}


def _megatron_line(r: dict, total: int, timing_level: int = 0) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    loss_scale = r.get("loss_scale")
    scale = (
        f" loss scale: {loss_scale:.1f} |"
        if loss_scale is not None and loss_scale >= 1
        else f" loss scale: {loss_scale:.3g} |"
        if loss_scale is not None
        else ""
    )
    mfu = (
        f"MFU: {100 * r['mfu']:.2f}% (peak {r['peak_tflops']:.3g} TFLOP/s)"
        if r.get("mfu") is not None
        else "MFU: n/a (no known peak; set --peak-tflops)"
    )
    extras = "".join(
        f" {label}: {fmt.format(r[key])} |"
        for key, label, fmt in (("num_zeros", "num zeros", "{:d}"), ("params_norm", "params norm", "{:.3f}"))
        if r.get(key) is not None
    )
    extras += "".join(f" {name}: {r[name]:.6E} |" for name in MOE_LOSSES if r.get(name) is not None)
    skipped = f" number of skipped iterations: {r['skipped_iterations']:3d} |" if "skipped_iterations" in r else ""
    if timing_level >= 1 and r.get("timers"):
        extras += "".join(f" {k} (ms): {1000 * v:.1f} |" for k, v in r["timers"].items())
    return (
        f" [{stamp}] iteration {r['iteration']:8d}/{total:8d} | consumed samples: {r['consumed_samples']:12d}"
        f" | elapsed time per iteration (ms): {r['elapsed_ms']:.1f} | learning rate: {r['lr']:.6E}"
        f" | global batch size: {r['global_batch_size']:5d} | lm loss: {r['lm_loss']:.6E} |{scale}"
        f" grad norm: {r['grad_norm']:.3f} |{extras}{skipped} tokens/s: {r['tokens_per_sec']:.1f}"
        f" | TFLOP/s/device: {r['tflops']:.3f} | {mfu} |"
    )


def write_loss_curve(path: str, records, eval_records=()):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["iteration"] for r in records], [r["lm_loss"] for r in records], label="train")
    if eval_records:
        ax.plot([r["iteration"] for r in eval_records], [r["lm_loss"] for r in eval_records], "o-", label="validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
