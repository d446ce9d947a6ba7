#!/usr/bin/env python
"""GPT pretraining with tensor + sequence parallelism (Megatron-LM flag names).

    torchrun --nproc-per-node 2 pretrain_gpt_sp.py --tensor-model-parallel-size 2 --sequence-parallel
    python pretrain_gpt_sp.py --help

With no data flags it trains a small GPT on the embedded corpus (Python's own documentation and
standard-library sources). See README.md and launch/ for clusters.
"""
import sys

from megatron_sp.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
