"""Data parallelism and the sharded optimizers: what the ranks holding the same shards (a parameter's
replicas: `ParallelState.replica_group`, the group of the parameter's `parallel_state.replica_role`) do
with its gradients and its optimizer state.

grad_buffers.py           Megatron's param-and-grad buffer: `param.main_grad` views of one buffer per bucket
grad_sync.py              the replica reduction of those buckets (overlapped with the backward or after it)
optimizer.py              AdamW on fp32 main weights, the true global gradient norm and clipping
distributed_optimizer.py  ZeRO-1 (--use-distributed-optimizer): the replicas split the AdamW state
loss_scale.py             fp16 loss scaling (Megatron's grad_scaler)
fsdp.py                   ZeRO-3 with torch's FSDP2 (--use-torch-fsdp2) and its optimizer
fsdp_checkpoint.py        FSDP2's checkpoint states, in the canonical entries every run reads
protocol.py               TrainingOptimizer: what the loop, the logs and checkpoints ask of both optimizers

Nothing here imports the training program (training/): the loop and the program build these.
"""
