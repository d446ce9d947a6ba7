"""ReferenceGPT: the serial oracle. The model spec built with plain torch.nn layers on whole tensors
(models/builders.py: SerialBuilder), one process, no collectives: it defines the function that
GPTModel must compute at any TP/SP size, dropout included (the parallelism-invariant masks).
Keys and shapes: models/language_model.py."""

from __future__ import annotations

import torch

from megatron_sp.models.builders import SerialBuilder
from megatron_sp.models.language_model import LanguageModel


class ReferenceGPT(LanguageModel):
    """Serial model of cfg.model's family (or of `spec`), in cfg.params_dtype on torch's default
    device (a shape-only model inside `with torch.device("meta")`). initialise=False leaves the
    weights uninitialised (to be loaded)."""

    def __init__(self, cfg, spec=None, *, initialise: bool = True):
        device = torch.get_default_device()
        super().__init__(cfg, SerialBuilder(cfg), spec)
        self.materialise(device, draw=initialise)
