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


@pytest.fixture(autouse=True)
def _seed_global_rngs():
    """Every test starts from the same global RNG state: under pytest-xdist, which tests ran earlier
    in a worker changes by run, and a test drawing from the global generator must not change with it."""
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers",
        "extension(op=None): needs megatron_sp._C (and torch.ops.megatron_sp.op); skipped without it, "
        "failed under MEGATRON_SP_REQUIRE_EXTENSION=1",
    )
    config.addinivalue_line("markers", "slow: multi-process end-to-end test")
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist runs a group in one worker (tests/conftest.py)")


# Files that share one system resource run in one pytest-xdist worker: the Slurm cluster (and its
# apt-get installation) of tests/slurm_cluster.py.
SHARED_GROUPS = {"test_slurm.py": "slurm", "test_slurm_faults.py": "slurm", "test_dist_env.py": "slurm"}
# The longest files first (seconds in a serial run, 2026-12-03), so that under `--dist loadgroup` no long
# file starts last and runs alone; the rest keep their order.
LONG_FIRST = (
    "slurm",
    "test_cuda_emulated.py",
    "test_pretrain.py",
    "test_reliability_ranks.py",
    "test_checkpoint.py",
    "test_parity.py",
    "test_megatron_flag_sets.py",
    "test_cp_training.py",
    "test_compile.py",
)


def _group(item) -> str:
    name = item.path.name
    return SHARED_GROUPS.get(name, name)


def _distribute(items) -> None:
    """Under pytest-xdist (`-n N --dist loadgroup`, as scripts/test.sh runs): each file's tests in one
    worker, so that a module's world, checkpoints and builds are made once; long files scheduled first."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    rank = {g: i for i, g in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: the order within a file holds


# tryfirst: the xdist_group marks must be on the items before pytest-xdist's own hook turns them into
# node-id suffixes (a mark added after it is ignored: _group_lost below).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _distribute(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip)


def _group_lost(item):
    """On a pytest-xdist worker under `--dist loadgroup`, every test's node id must carry its group
    (xdist's suffix, added after our marks), or the groups are silently ignored: each file's tests are
    spread over the workers, every worker builds the file's worlds, and the suite runs minutes longer
    (pytest 9.2 with pytest-xdist 3.8 did). Each test then fails, saying so."""
    # (workerinput: this process is itself a worker; a pytest run started by a test inherits the
    # worker's environment but is not one)
    on_worker = hasattr(item.config, "workerinput") and getattr(item.config.option, "loadgroup", False)
    if "@" in item.nodeid or not on_worker:
        return None
    import xdist

    return (
        f"pytest-xdist {xdist.__version__} ignored the xdist_group marks under pytest {pytest.__version__}: "
        "pin a pair that keeps them (requirements-dev.txt)"
    )


def pytest_runtest_setup(item):
    """Tests marked `extension` skip without megatron_sp._C, or fail under MEGATRON_SP_REQUIRE_EXTENSION=1."""
    lost = _group_lost(item)
    if lost:
        pytest.fail(lost, pytrace=False)
    mark = item.get_closest_marker("extension")
    if mark is None:
        return
    from megatron_sp.testing import extension_missing, extension_required, required_message

    missing = extension_missing(*mark.args)
    if missing and extension_required():
        pytest.fail(required_message(missing), pytrace=False)
    if missing:
        pytest.skip(missing)
