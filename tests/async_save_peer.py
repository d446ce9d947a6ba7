"""Run as two ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set) by tests/test_reliability_ranks.py: both
make --async-save's group; rank 0 starts a background save that rank 1 never joins (a SIGSTOPped or
dead peer). Rank 0 prints how long the save's thread took to fail: within the world's timeout, not
torch's 30 minutes for a group made without one (issue 39)."""

import os
import sys
import time
from datetime import timedelta


def main(tmp: str) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron_sp.checkpointing import async_save

    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    async_save._save_group()  # collective: both ranks, as at the first save
    if dist.get_rank() == 1:
        time.sleep(120)  # never joins the save's collectives
        return 0
    start = time.monotonic()
    future = async_save.background_save({"w": torch.ones(4)}, os.path.join(tmp, "iter_0000001.tmp"), dcp)
    try:
        future.result(timeout=90)
        print("saved without the peer?!", flush=True)
        return 1
    except Exception as err:  # noqa: BLE001 - the peer never came: what the worker raised
        print(f"failed after {time.monotonic() - start:.2f} s: {type(err).__name__}", flush=True)
        os._exit(0)  # not waiting for rank 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    sys.exit(main(sys.argv[1]))
