#!/usr/bin/env python
"""GPT pretraining with tensor + sequence parallelism (Megatron-LM flag names).

    torchrun --nproc-per-node 2 pretrain_gpt_sp.py --tensor-model-parallel-size 2 --sequence-parallel
    python pretrain_gpt_sp.py --help

With no data flags it trains a small GPT on the embedded corpus (Python's own documentation and
standard-library sources). See README.md and launch/ for clusters.
"""

import sys

if __name__ == "__main__":
    # First, before torch is imported: a SIGUSR1/SIGTERM/SIGINT during start-up is recorded (the run
    # stops at its first iteration boundary) instead of killing this rank (signals.py imports no torch).
    from megatron_sp.training.signals import ExitSignalHandler

    signals = ExitSignalHandler().install()
    from megatron_sp.training.pretrain import main

    sys.exit(main(signals=signals))
