"""The planner's models (tools/plan.py): what a layout holds per GPU and how long its step takes.

activations.py  bytes saved for backward per layer and for the head (Korthikanti et al.'s
                accounting adjusted to our layers; bench/activation_memory.py measures them)
memory.py       the parameter inventory of one rank, weights / gradients / optimizer state /
                buffers per rank for a precision mode and a sharding (replicated, distributed
                optimizer, FSDP2), and the activations with recomputation and pipeline stages
cost.py         bytes communicated per step and the step-time model
layouts.py      the layouts of a cluster (tp, cp, dp, pp, sp, recompute, sharding), feasibility
                and ranking

Everything here is arithmetic on a GPTConfig: no process group, no tensor.
"""
