#!/usr/bin/env python
"""Generate text from a megatron_sp checkpoint (any TP/CP size it was saved at): a sanity check of
what a run has learnt, one process, no torch.distributed.

    python tools/generate.py --load runs/ckpt --prompt "def main(" [--max-new-tokens 64]
        [--temperature 0 | --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1] [--iteration N]
        [--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/tokenizer.json] [--device cuda --bf16]

The tokenizer flags are pretrain_gpt_sp.py's (default ByteLevelTokenizer, as the default run). The
model is the serial ReferenceGPT with the checkpoint's config, dropout off; every new token runs
the whole window again (no key/value cache: simple, and fast enough for a check), the window being
the last max_position_embeddings tokens. --temperature 0 is greedy decoding; generation stops at
the tokenizer's end-of-document id unless --ignore-eod.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

TOKENIZERS = ["ByteLevelTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"]


def load_model(load: str, iteration=None, device: str = "cpu", dtype=None):
    """(ReferenceGPT in eval mode, its GPTConfig) from a checkpoint directory."""
    from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state
    from megatron_sp.config import config_from_dict
    from megatron_sp.models.reference import ReferenceGPT

    state, meta = read_full_state(checkpoint_path(load, iteration))
    cfg = config_from_dict(
        meta["config"], hidden_dropout=0.0, attention_dropout=0.0, use_fused_kernels=device == "cuda"
    )
    model = ReferenceGPT(cfg, initialise=False)
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval(), cfg


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top k / the smallest set with probability >= top_p set to -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the tokens after the set is complete
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eod=None,
    generator=None,
) -> torch.Tensor:
    """ids [b, s] -> [b, s + n] with n <= max_new_tokens new tokens (fewer when every row reached eod;
    a row that has stops changing: it is padded with eod)."""
    window = model.cfg.max_position_embeddings
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -window:])[:, -1].float()
        if temperature == 0.0:
            nxt = logits.argmax(dim=-1)
        else:
            probs = _filter(logits / temperature, top_k, top_p).softmax(dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        if eod is not None:
            nxt = torch.where(done, torch.full_like(nxt, eod), nxt)
            done |= nxt == eod
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if eod is not None and bool(done.all()):
            break
    return ids


def _check_flags(args) -> None:
    """The sampling flags in range and --device one this machine has (ValueError)."""
    for flag, value, ok in (
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 0),
        ("--temperature", args.temperature, math.isfinite(args.temperature) and args.temperature >= 0),
        ("--top-k", args.top_k, args.top_k >= 0),
        ("--top-p", args.top_p, 0 < args.top_p <= 1),
    ):
        if not ok:
            raise ValueError(f"{flag} {value} is out of range.")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ValueError(f"--device {args.device} is not one generate.py runs on (cpu, cuda, cuda:N).")
    if args.device != "cpu":
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device {args.device} is not a device name (cpu, cuda, cuda:N).") from None
        if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--device {args.device}: this machine has no such CUDA device; use --device cpu.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True)
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--prompt", default="", help="text to continue (default: start from the EOD token)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    p.add_argument("--top-p", type=float, default=1.0, help="1: no nucleus filter")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ignore-eod", action="store_true", help="keep generating after the end-of-document id")
    p.add_argument("--tokenizer-type", choices=TOKENIZERS, default="ByteLevelTokenizer")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args(argv)
    try:
        _check_flags(args)
        from megatron_sp.data import build_tokenizer

        tokenizer = build_tokenizer(
            args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file, args.merge_file
        )
        model, cfg = load_model(args.load, args.iteration, args.device, torch.bfloat16 if args.bf16 else None)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the checkpoint's model "
                f"{cfg.vocab_size}: use the tokenizer it was trained with."
            )
        prompt = tokenizer.tokenize(args.prompt) if args.prompt else [tokenizer.eod]
        outside = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if outside:
            raise ValueError(f"the prompt holds id {outside[0]}, outside the model's vocabulary of {cfg.vocab_size}.")
    except (ValueError, OSError) as err:  # DataError, CheckpointError, GPTConfig's ValueError
        print(f"generate.py: error: {err}", file=sys.stderr)
        return 2
    ids = torch.tensor([prompt], device=args.device)
    out = generate(
        model,
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eod=None if args.ignore_eod else tokenizer.eod,
        generator=torch.Generator(args.device).manual_seed(args.seed),
    )
    new = [t for t in out[0, len(prompt) :].tolist() if args.ignore_eod or t != tokenizer.eod]
    print(tokenizer.detokenize((prompt if args.prompt else []) + new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
