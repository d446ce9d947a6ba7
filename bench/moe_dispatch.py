"""Mixture of experts at CPU size (issue 31, item 6): the all-to-all bytes each rank sends per step
against the formula, the tokens each expert gets, CPU step time at EP1 and EP2, and the bf16 drift of
EP2 against the serial bf16 model.

    python bench/moe_dispatch.py          # Llama-style, 2 layers × 64 wide, 8 experts top-2, s=64 b=4; 2 ranks

1. Bytes: every dist.all_to_all_single of one forward + backward at EP2 (--moe-token-dispatcher-type
   alltoall) counted by what leaves the rank (the rows for its own experts stay). The formula, per MoE
   layer, with R the routed rows the rank sends to the other EP rank (its tokens' choices of experts
   held there) and R' the rows the other rank sends to this rank's experts (both read from the routing):
       forward   R (h e + 4) + R' h e       rows and their weights (fp32) there, the experts' outputs back
       backward  R h e + R' (h e + 4)       the outputs' gradients there, the rows' and weights' back
   plus the counts, (P - 1) E_l integers of 8 bytes per layer; e = 4 bytes (fp32). Uniform routing
   would make R = R' = n k (P - 1) / P.
2. Tokens per expert: each layer's routed rows per expert in that step (sum n k).
3. Step time: the mean of 5 forward + backward steps (after 2 warm-up), EP1 (DP2) and EP2 (DP2 × EP2)
   on 2 ranks; 2 shared CPU cores: no speed claim.
4. bf16: one step's loss and gradient-norm drift of EP2 against the serial model, both in bf16.
"""

from __future__ import annotations

import sys
import time

import torch

from megatron_sp.testing import LocalWorld

FIELDS = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    seq_length=64,
    model="llama",
    num_experts=8,
    moe_ffn_hidden_size=64,
    moe_router_topk=2,
    moe_aux_loss_coeff=1e-2,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    moe_token_dispatcher_type="alltoall",
)
BATCH = 4


def _batch(step=0):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, FIELDS["vocab_size"], (BATCH, FIELDS["seq_length"]), generator=g)
    return tokens, torch.roll(tokens, -1, 1)


def _model(ep, dtype="fp32"):
    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.gpt import GPTModel

    cfg = GPTConfig(**FIELDS, expert_model_parallel_size=ep, params_dtype=dtype)
    ps = parallel_state.initialize_model_parallel(1, expert_model_parallel_size=ep)
    return cfg, ps, GPTModel(cfg, ps)


def _measure_bytes():
    """(sent bytes, formula bytes, tokens per expert per layer) on this rank, one step at EP2."""
    import torch.distributed as dist

    cfg, ps, model = _model(2)
    tokens, labels = _batch()
    part = slice(ps.dp_rank * BATCH // ps.dp_size, (ps.dp_rank + 1) * BATCH // ps.dp_size)
    from megatron_sp.expert_parallel import alltoall

    sent, routes = [0], []
    real, real_counts = alltoall._a2a_once, alltoall._counts_a2a

    def counting(x, out_splits, in_splits, group):  # every exchange, forward and backward
        sent[0] += (x.shape[0] - in_splits[dist.get_rank(group)]) * x[0].numel() * x.element_size()
        return real(x, out_splits, in_splits, group)

    def counting_counts(send, group):
        sent[0] += (send.numel() - send.shape[1]) * send.element_size()
        return real_counts(send, group)

    def record(module, args, out):
        routes.append(out[1].sum(0))  # [E] routed rows of this rank's tokens

    hooks = [m.router.register_forward_hook(record) for m in (b.mlp for b in model.layers)]
    alltoall._a2a_once, alltoall._counts_a2a = counting, counting_counts
    try:
        model(tokens[part], labels[part]).backward()
    finally:
        alltoall._a2a_once, alltoall._counts_a2a = real, real_counts
        for h in hooks:
            h.remove()
    local, h, formula = cfg.num_experts // 2, cfg.hidden_size, 0
    for counts in routes:
        there = counts.view(2, local)
        r_out = int(there[1 - ps.ep_rank].sum())  # rows to the other rank's experts
        everyone = [torch.zeros_like(there) for _ in range(2)]
        dist.all_gather(everyone, there, group=ps.ep_group)
        r_in = int(everyone[1 - ps.ep_rank][ps.ep_rank].sum())  # the other rank's rows to mine
        formula += (r_out + r_in) * (2 * h * 4 + 4) + local * 8
    full = [torch.zeros_like(routes[0]) for _ in range(2)]
    per_layer = []
    for counts in routes:
        dist.all_gather(full, counts, group=ps.ep_group)
        per_layer.append(sum(full).tolist())
    return sent[0], formula, per_layer, int(tokens[part].numel())


def _step_time(ep):
    cfg, ps, model = _model(ep)
    tokens, labels = _batch()
    part = slice(ps.dp_rank * BATCH // ps.dp_size, (ps.dp_rank + 1) * BATCH // ps.dp_size)
    times = []
    for i in range(7):
        start = time.perf_counter()
        model(tokens[part], labels[part]).backward()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return sum(times) / len(times)


def _bf16_drift():
    """(loss drift, gradient-norm drift) of EP2 against the serial model, both bf16, one step."""
    from megatron_sp.config import GPTConfig
    from megatron_sp.distributed.optimizer import global_grad_norm
    from megatron_sp.models.reference import ReferenceGPT

    cfg, ps, model = _model(2, "bf16")
    serial = ReferenceGPT(GPTConfig(**FIELDS, params_dtype="bf16"))
    serial.load_state_dict(model.full_state_dict())
    tokens, labels = _batch()
    want = serial(tokens, labels)
    want.backward()
    want_norm = torch.stack([p.grad.float().norm() for p in serial.parameters()]).norm().item()
    part = slice(ps.dp_rank * BATCH // ps.dp_size, (ps.dp_rank + 1) * BATCH // ps.dp_size)
    loss = model(tokens[part], labels[part])
    loss.backward()
    model.partial_grads.reduce(model.parameters())
    import torch.distributed as dist

    from megatron_sp.parallel_state import REPLICAS, replica_role

    for p in model.parameters():
        if replica_role(p) == REPLICAS and p.grad is not None:
            dist.all_reduce(p.grad, group=ps.dp_group)
            p.grad /= ps.dp_size
    got = loss.detach().float().clone()
    dist.all_reduce(got, group=ps.dp_group)
    norm = global_grad_norm(list(model.parameters()), ps).item()
    return abs(got.item() / ps.dp_size - want.item()) / want.item(), abs(norm - want_norm) / want_norm


def main() -> int:
    world = LocalWorld(2)
    try:
        measured = world.run(_measure_bytes)
        times = {ep: world.run(_step_time, ep)[0] for ep in (1, 2)}
        drift = world.run(_bf16_drift)[0]
    finally:
        world.close()
    ok = True
    print("| rank | all-to-all bytes sent (measured) | formula | uniform routing | equal |")
    print("|---|---|---|---|---|")
    k, h, layers = FIELDS["moe_router_topk"], FIELDS["hidden_size"], FIELDS["num_layers"]
    for rank, (sent, formula, _, n) in enumerate(measured):
        uniform = layers * (n * k * (2 * h * 4 + 4) + FIELDS["num_experts"] // 2 * 8)
        ok &= sent == formula
        print(f"| {rank} | {sent} | {formula} | {uniform:.0f} | {sent == formula} |")
    print("\n| layer | routed rows per expert (both ranks, n k = %d) |" % (BATCH * FIELDS["seq_length"] * k))
    print("|---|---|")
    for layer, counts in enumerate(measured[0][2], 1):
        print(f"| {layer} | {' '.join(str(int(c)) for c in counts)} |")
    print(f"\nstep (forward + backward) on 2 ranks: EP1 × DP2 {1000 * times[1]:.1f} ms, EP2 {1000 * times[2]:.1f} ms")
    print(f"bf16 EP2 vs serial bf16, one step: loss {drift[0]:.2e}, gradient norm {drift[1]:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
