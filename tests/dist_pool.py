"""The tests' persistent gloo world: megatron_sp.local_world.LocalWorld (one per test module)."""

from megatron_sp.local_world import LocalWorld as WorkerPool  # noqa: F401
