"""ExitSignalHandler: a signal on one rank makes every rank stop at the same iteration boundary."""

import os
import signal

import pytest
import torch.distributed as dist

from megatron_sp.testing import LocalWorld
from megatron_sp.training.signals import ExitSignalHandler


@pytest.fixture(scope="module")
def pool():
    p = LocalWorld(2)
    yield p
    p.close()


def _signal_one_rank(signalled_rank, sig):
    handler = ExitSignalHandler(device="cpu").install()
    try:
        before = handler.should_exit()
        if dist.get_rank() == signalled_rank:
            os.kill(os.getpid(), sig)  # the Python handler runs before the next bytecode
        return before, handler.received(), handler.should_exit()
    finally:
        handler.uninstall()


@pytest.mark.parametrize("signalled_rank, sig", [(1, signal.SIGUSR1), (0, signal.SIGTERM)])
def test_one_rank_signalled_stops_every_rank(pool, signalled_rank, sig):
    results = pool.run(_signal_one_rank, signalled_rank, sig)
    assert [before for before, _, _ in results] == [False, False]
    assert [got for _, got, _ in results] == [r == signalled_rank for r in range(2)]
    assert [stop for _, _, stop in results] == [True, True]


def _agree_over_group():
    handler = ExitSignalHandler().install()
    try:
        group = dist.new_group([0, 1])
        quiet = handler.should_exit(group=group, device="cpu")
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return quiet, handler.should_exit(group=group)
    finally:
        handler.uninstall()


def test_should_exit_over_a_group(pool):
    assert pool.run(_agree_over_group) == [(False, True), (False, True)]


def test_single_process_is_local_and_uninstall_restores():
    previous, previous_term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    marker = []
    signal.signal(signal.SIGUSR1, lambda *a: marker.append("old"))
    try:
        with ExitSignalHandler() as handler:
            assert not handler.should_exit()  # no process group: the local flag
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert handler.received() and handler.should_exit()
            assert handler.received_signal == signal.SIGUSR1  # the first one is kept
            assert marker == []  # our handler replaced the old one ...
        os.kill(os.getpid(), signal.SIGUSR1)
        assert marker == ["old"]  # ... and uninstall put it back
        assert signal.getsignal(signal.SIGTERM) == previous_term
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_install_only_the_signals_asked_for():
    previous = signal.getsignal(signal.SIGUSR2)
    handler = ExitSignalHandler().install(signals=(signal.SIGUSR2,))
    try:
        assert signal.getsignal(signal.SIGUSR2) == handler._handle
        assert signal.getsignal(signal.SIGTERM) != handler._handle
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == previous
