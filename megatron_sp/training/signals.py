"""Stop cleanly on SIGTERM / SIGUSR1: every rank agrees to stop at the same iteration boundary.

Slurm sends SIGUSR1 before the time limit (`#SBATCH --signal=USR1@120`, forwarded to the ranks by
launch/*.sbatch) and SIGTERM on cancellation or preemption. Signals reach ranks at different
moments, so a rank must not act on its own flag: `should_exit()` all-reduces the flags (MAX) and
every rank sees True as soon as one rank got a signal, at the same iteration.

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

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitSignalHandler:
    """Records the first of `signals` this process receives; `should_exit` agrees across ranks.

    device: where the all-reduced flag lives: "cpu" for gloo, "cuda" for NCCL.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
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

    def should_exit(self, group=None, device: str | torch.device | None = None) -> bool:
        """Collective over `group` (default: the world): True on every rank if any rank got a signal.

        Without an initialised process group this is `received()`.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return self.received()
        flag = torch.tensor([1 if self.received() else 0], dtype=torch.int32,
                            device=self.device if device is None else torch.device(device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
