"""Stop cleanly on SIGTERM / SIGUSR1 / SIGINT: every rank agrees to stop at the same iteration boundary.

Slurm sends SIGUSR1 before the time limit (`#SBATCH --signal=USR1@120`, forwarded to the ranks by
launch/*.sbatch) and SIGTERM on cancellation or preemption; torchrun forwards SIGINT (Ctrl-C) and
SIGTERM to its workers. Signals reach ranks at different moments, so a rank must not act on its
own flag: `should_exit()` all-reduces the flags (MAX) and every rank sees True as soon as one rank
got a signal, at the same iteration.

The handler is meant to be installed first thing (pretrain_gpt_sp.py does it before importing
torch) and kept until the process exits: a signal during start-up or after the last iteration is
recorded instead of killing the rank (SIGUSR1's default action is to terminate). This module
imports torch only when it communicates.

    handler = ExitSignalHandler(device="cuda").install()
    for iteration in ...:
        train_step()
        if handler.should_exit():          # collective: call it on every rank, every iteration
            save_checkpoint(); break
    handler.uninstall()
"""

from __future__ import annotations

import signal
from typing import Iterable

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class ExitSignalHandler:
    """Records the first of `signals` this process receives; `should_exit` agrees across ranks.

    device: where the all-reduced flag lives: "cpu" for gloo, "cuda" for NCCL (settable later,
    when the handler was installed before the device was known).
    """

    def __init__(self, device="cpu"):
        self.device = device
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def install(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> "ExitSignalHandler":
        """Installs the handler (from the main thread, as Python requires); returns self."""
        for sig in map(signal.Signals, signals):
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def uninstall(self) -> None:
        """Restores the handlers that were there before `install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "ExitSignalHandler":
        return self.install() if not self._previous else self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum, frame) -> None:
        # Only a flag: the training loop acts on it at the next iteration boundary.
        if self._received is None:
            self._received = signal.Signals(signum)

    def received(self) -> bool:
        """Whether this process got one of the signals (local, no communication)."""
        return self._received is not None

    @property
    def received_signal(self) -> signal.Signals | None:
        """The first signal received, for the log line ("got SIGUSR1, saving and exiting")."""
        return self._received

    def should_exit(self, group=None, device=None) -> bool:
        """Collective over `group` (default: the world): True on every rank if any rank got a signal.

        Without an initialised process group this is `received()`.
        """
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.received()
        flag = torch.tensor(
            [1 if self.received() else 0],
            dtype=torch.int32,
            device=torch.device(self.device if device is None else device),
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


EXIT_STATUS_ENV = "MEGATRON_SP_EXIT_STATUS_FILE"


def write_exit_status(finished: bool, iteration: int) -> None:
    """Tells the launcher how training ended (rank 0 only): "finished N" or "stopped N".

    launch/slurm_common.sh sets MEGATRON_SP_EXIT_STATUS_FILE and requeues the job after SIGUSR1 only
    when the file does not say "finished": a signal that lands after the last iteration must not
    start the job again. Without the variable nothing is written.
    """
    import os

    path = os.environ.get(EXIT_STATUS_ENV)
    if not path or _rank() != 0:
        return
    from megatron_sp.checkpointing import files  # (torch is loaded by now)

    files.write_atomic(path, f"{'finished' if finished else 'stopped'} {iteration}\n".encode())  # no link followed


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
