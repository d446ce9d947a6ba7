"""Pipeline parallelism: stages of whole layers (layout.py) run by torch.distributed.pipelining's
schedules (model.py: PipelineGPT)."""
