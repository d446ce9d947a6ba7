"""ReferenceGPT: the serial oracle. The model spec built with plain torch.nn layers on whole tensors
(models/builders.py: SerialBuilder), one process, no collectives: it defines the function that
GPTModel must compute at any TP/SP size, dropout included (the parallelism-invariant masks).
Keys and shapes: models/language_model.py."""

from __future__ import annotations

import torch

from megatron_sp.models.builders import SerialBuilder
from megatron_sp.models.init import init_full_tensor
from megatron_sp.models.language_model import LanguageModel


class ReferenceGPT(LanguageModel):
    """Serial model of cfg.model's family (or of `spec`). initialise=False skips drawing the weights
    (a shape-only model, e.g. on the meta device)."""

    def __init__(self, cfg, spec=None, *, initialise: bool = True):
        super().__init__(cfg, SerialBuilder(), spec)
        if initialise:
            with torch.no_grad():
                for name, param in self.named_parameters():
                    param.copy_(init_full_tensor(name, tuple(param.shape), param.init_tag, cfg))
