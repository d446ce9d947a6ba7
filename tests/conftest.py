"""Shared pytest configuration: the markers (cuda, extension, slow) and a clean environment per test."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _restore_environ():
    """In-process runs of pretrain_gpt_sp's main() export RANK/WORLD_SIZE/...; keep them from
    leaking into later tests' subprocesses (a leaked WORLD_SIZE=1 would win over Slurm's)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers",
        "extension(op=None): needs megatron_sp._C (and torch.ops.megatron_sp.op); skipped without it, "
        "failed under MEGATRON_SP_REQUIRE_EXTENSION=1",
    )
    config.addinivalue_line("markers", "slow: multi-process end-to-end test")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    """Tests marked `extension` skip without megatron_sp._C, or fail under MEGATRON_SP_REQUIRE_EXTENSION=1."""
    mark = item.get_closest_marker("extension")
    if mark is None:
        return
    from megatron_sp.testing import extension_missing, extension_required, required_message

    missing = extension_missing(*mark.args)
    if missing and extension_required():
        pytest.fail(required_message(missing), pytrace=False)
    if missing:
        pytest.skip(missing)
