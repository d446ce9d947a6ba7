"""A stand-in for pretrain_gpt_sp.py that exercises only the launch path (seconds, no model).

It joins the world through megatron_sp.training.dist_env, runs `--train-iters` "iterations" of one
all-reduce each, logs one JSON line per iteration like the training program (iteration, lm_loss,
...), stops at an iteration boundary on SIGUSR1/SIGTERM through ExitSignalHandler, and keeps a
one-number "checkpoint" (--save/--load) so that preemption and requeue can be tested end to end.

The "loss" of iteration i is a pure function of i and the world size, computed with an all-reduce,
so a run that is interrupted and resumed logs exactly the numbers of an uninterrupted one.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_sp.training.dist_env import destroy_distributed, init_distributed
from megatron_sp.training.signals import ExitSignalHandler


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--distributed-backend", default="gloo")
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--log-jsonl", required=True)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--save-interval", type=int, default=0)
    p.add_argument("--iter-sleep", type=float, default=0.0, help="seconds per iteration")
    p.add_argument("--distributed-timeout-s", type=float, default=600)
    p.add_argument(
        "--slow-restart-s",
        type=float,
        default=0.0,
        help="after a torchrun restart, rank 1 joins this much later (the others find "
        "the previous attempt's keys in a reused store first, if it is reused)",
    )
    args, _unknown = p.parse_known_args(argv)  # training flags we do not model are ignored
    return args


def probe_loss(iteration: int, device: str) -> float:
    """sum over ranks of (rank + 1) * iteration, through an all-reduce, squashed into a 'loss'."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    value = torch.tensor([float((rank + 1) * iteration)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(value)
    return 10.0 / (1.0 + 0.01 * value.item())


def load_iteration(load_dir) -> int:
    path = os.path.join(load_dir or "", "probe_checkpoint.json")
    if not load_dir or not os.path.exists(path):
        return 0
    with open(path) as f:
        return json.load(f)["iteration"]


def save_iteration(save_dir, iteration: int, rank: int) -> None:
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        tmp = os.path.join(save_dir, "probe_checkpoint.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"iteration": iteration}, f)
        os.replace(tmp, os.path.join(save_dir, "probe_checkpoint.json"))
    if dist.is_initialized():
        dist.barrier()


def write_env(args, env) -> None:
    """All ranks' view of the launch (rank, local rank, pid, ...) to <log-jsonl>.env.json."""
    mine = {
        **env.__dict__,
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
        "torchrun_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    }
    views = [None] * env.world_size
    if dist.is_initialized():
        dist.all_gather_object(views, mine)
    else:
        views = [mine]
    if env.rank == 0:
        with open(args.log_jsonl + ".env.json", "w") as f:
            json.dump(views, f)


def main(argv=None) -> int:
    args = parse_args(argv)
    handler = ExitSignalHandler(device=args.device).install()
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and os.environ.get("RANK") == "1":
        time.sleep(args.slow_restart_s)
    env = init_distributed(args.distributed_backend, args.device, args.distributed_timeout_s)
    write_env(args, env)
    start = load_iteration(args.load)
    for iteration in range(start + 1, args.train_iters + 1):
        time.sleep(args.iter_sleep)
        loss = probe_loss(iteration, args.device)
        if env.rank == 0:
            with open(args.log_jsonl, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "iteration": iteration,
                            "lm_loss": loss,
                            "world_size": env.world_size,
                            "launcher": env.launcher,
                        }
                    )
                    + "\n"
                )
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_iteration(args.save, iteration, env.rank)
        if handler.should_exit():
            got = getattr(handler.received_signal, "name", "nothing")
            print(f"rank {env.rank}: exit signal at iteration {iteration} (this rank got {got}), saving", flush=True)
            if args.save:
                save_iteration(args.save, iteration, env.rank)
            break
    else:
        if args.save:
            save_iteration(args.save, args.train_iters, env.rank)
    destroy_distributed()
    handler.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
