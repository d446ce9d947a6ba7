"""The serial MoE layer (models/moe/) against direct computations written token by token here: the
router's choices and weights (softmax, pre-softmax, sigmoid, scaling, group-limited, expert bias,
Sinkhorn),
the layer's output and gradients, the load-balancing and z losses, capacity drops per sample, the
grouped GEMM against the per-expert loop, --moe-layer-freq, and the refusals (issue 31, item 7)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.config import GPTConfig
from megatron_sp.models.moe import capacity as capacity_mod
from megatron_sp.models.moe.router import sinkhorn, sinkhorn_routing, topk_routing
from megatron_sp.models.reference import ReferenceGPT

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=97, seq_length=16)
E = 8


def _cfg(**extra):
    fields = dict(BASE, model="llama", num_experts=E, moe_ffn_hidden_size=32, hidden_dropout=0.0)
    fields.update(attention_dropout=0.0)
    return GPTConfig(**{**fields, **extra})


def _direct_route(logits, cfg, bias=None):
    """Token by token: {expert: weight} of each token."""
    out = []
    k = cfg.moe_router_topk
    for row in logits.double():
        if cfg.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(row)
        elif cfg.moe_router_pre_softmax:
            scores = torch.softmax(row, -1)
        else:
            scores = row
        choice = scores + (bias if bias is not None else 0)
        allowed = list(range(E))
        if cfg.moe_router_num_groups:
            g, size = cfg.moe_router_num_groups, E // cfg.moe_router_num_groups
            per = k // cfg.moe_router_group_topk
            gscore = [sorted(choice[i * size : (i + 1) * size].tolist(), reverse=True)[:per] for i in range(g)]
            best = sorted(range(g), key=lambda i: -sum(gscore[i]))[: cfg.moe_router_group_topk]
            allowed = [e for e in range(E) if e // size in best]
        top = sorted(allowed, key=lambda e: -choice[e].item())[:k]
        if cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax:
            w = torch.softmax(row[top], -1)
        else:
            w = scores[top] / (scores[top].sum() if cfg.moe_router_score_function == "sigmoid" and k > 1 else 1)
        w = w * (cfg.moe_router_topk_scaling_factor or 1.0)
        out.append(dict(zip(top, w.tolist())))
    return out


ROUTERS = {
    "top2": {},
    "top1": dict(moe_router_topk=1),
    "pre-softmax": dict(moe_router_pre_softmax=True, moe_router_topk=3),
    "sigmoid": dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
    "group-limited": dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4),
    "group-limited-sigmoid": dict(
        moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2
    ),
}


@pytest.mark.parametrize("name", ROUTERS)
def test_router_against_direct_choice(name):
    cfg = _cfg(**ROUTERS[name])
    logits = torch.randn(40, E, generator=torch.Generator().manual_seed(3))
    probs, routing_map = topk_routing(logits, cfg)
    for t, want in enumerate(_direct_route(logits, cfg)):
        assert sorted(routing_map[t].nonzero().flatten().tolist()) == sorted(want)
        for e, w in want.items():
            assert abs(probs[t, e].item() - w) < 1e-6
    assert (probs[~routing_map] == 0).all()


def test_expert_bias_moves_the_choice_not_the_weights():
    cfg = _cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    logits = torch.randn(40, E, generator=torch.Generator().manual_seed(4))
    bias = torch.linspace(-0.5, 0.5, E)
    probs, routing_map = topk_routing(logits, cfg, bias)
    unbiased, _ = topk_routing(logits, cfg)
    for t, want in enumerate(_direct_route(logits, cfg, bias.double())):
        assert sorted(routing_map[t].nonzero().flatten().tolist()) == sorted(want)
        assert all(abs(probs[t, e].item() - w) < 1e-6 for e, w in want.items())
    assert not torch.equal(probs, unbiased)


def _direct_sinkhorn_choice(logits, k):
    """Sinkhorn-Knopp in float64, written as matrix-vector products: K = exp(logits); scale rows to 1/T,
    then columns to 1/E, until the column scales change by at most 1e-4 on average; each token's top-k
    of the balanced matrix."""
    K = torch.exp(logits.double())
    t, e = K.shape
    v = torch.ones(e, dtype=torch.float64)
    while True:
        u = (1 / t) / (K @ v + 1e-8)
        v_new = (1 / e) / (K.t() @ u + 1e-8)
        change, v = (v_new - v).abs().mean().item(), v_new
        if change <= 1e-4:
            break
    balanced = u[:, None] * K * v[None, :]
    return balanced, balanced.topk(k, dim=1)[1]


@pytest.mark.parametrize("k", [1, 2])
def test_sinkhorn_routing_against_direct(k):
    """Training: the top-k of the Sinkhorn-balanced scores, weighted by sigmoid (k = 1) or the softmax
    over every expert (k > 1), as Megatron's sinkhorn_load_balancing; the balanced matrix's rows sum to
    1/T and its columns to 1/E. Evaluation: the top-k of the weights."""
    cfg = _cfg(moe_router_load_balancing_type="sinkhorn", moe_router_topk=k)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, E, generator=g) + torch.linspace(0, 3, E)  # (skewed to the last experts)
    balanced, want = _direct_sinkhorn_choice(logits, k)
    got = sinkhorn(logits)
    assert torch.allclose(got.double(), balanced, rtol=1e-4, atol=1e-9)
    assert torch.allclose(got.sum(0).double(), torch.full((E,), 1 / E, dtype=torch.float64), rtol=1e-5)
    assert torch.allclose(got.sum(1).double(), torch.full((64,), 1 / 64, dtype=torch.float64), rtol=5e-3)
    weights = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, -1)
    for training, top in ((True, want), (False, weights.topk(k, dim=1)[1])):
        probs, routing_map = sinkhorn_routing(logits, cfg, training=training)
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, top, True))
        assert torch.allclose(probs, weights * routing_map, atol=1e-7)
    # the point of it: the skewed logits' plain top-k loads the last experts, Sinkhorn's spreads them
    plain = torch.zeros(E).scatter_add(0, logits.topk(k, 1)[1].flatten(), torch.ones(64 * k))
    balanced_load = torch.zeros(E).scatter_add(0, want.flatten(), torch.ones(64 * k))
    assert balanced_load.max() < plain.max() and balanced_load.min() > plain.min()


def _expert(layer, e, x, p, cfg):
    """One expert, as the docs write it: fc2(p · act(fc1 x + b1)) + p · b2 (Megatron's: gpt-oss's
    p · expert(x)), gpt-oss's clamped quick-GeGLU with its offset included."""
    ex = layer.experts.local_experts[str(e)]
    a = F.linear(x, ex.fc1.weight, ex.fc1.bias)
    if cfg.activation == "swiglu":
        gate, up = a.chunk(2, -1)
        a = F.silu(gate) * up
    elif cfg.activation == "quick_geglu":
        gate, up = a.chunk(2, -1)
        c = cfg.activation_func_clamp_value
        gate, up = gate.clamp(max=c), up.clamp(-c, c)
        a = gate * torch.sigmoid(1.702 * gate) * (up + cfg.glu_linear_offset)
    else:
        a = F.gelu(a)
    return p * F.linear(a, ex.fc2.weight, ex.fc2.bias)


def _direct_layer(layer, x, cfg, keep=None):
    """[s, b, h] output of the MoE layer token by token (keep: a token's kept experts, or all)."""
    s, b, h = x.shape
    tokens = x.reshape(-1, h)
    logits = tokens @ layer.router.weight.t() + (0 if layer.router.bias is None else layer.router.bias)
    out = []
    for t, choice in enumerate(_direct_route(logits.detach(), cfg)):
        weights = torch.softmax(logits[t, list(choice)], -1) if cfg.moe_router_score_function == "softmax" else None
        y = tokens.new_zeros(h)
        for i, e in enumerate(choice):
            if keep is None or e in keep[t]:
                y = y + _expert(layer, e, tokens[t], weights[i], cfg)
        out.append(y)
    y = torch.stack(out).view(s, b, h)
    if layer.shared_experts is not None:
        sh = layer.shared_experts
        a = F.silu(F.linear(x, sh.fc1.weight).chunk(2, -1)[0]) * F.linear(x, sh.fc1.weight).chunk(2, -1)[1]
        gate = 1.0 if sh.gate_weight is None else torch.sigmoid(x @ sh.gate_weight.t())  # [s, b, 1]
        y = y + gate * F.linear(a, sh.fc2.weight)
    return y


def _run_layer(cfg, seed=0, s=16, b=2):
    model = ReferenceGPT(cfg)
    layer = model.layers[0].mlp
    x = torch.randn(s, b, cfg.hidden_size, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    seq = model.builder.sequence_context(cfg, torch.zeros(b, s, dtype=torch.long), **_batch(True))
    return model, layer, x, seq


def _batch(training):
    return dict(labels=None, loss_mask=None, position_ids=None, attention_mask=None, sample_ids=None, training=training)


SHARED = dict(moe_shared_expert_intermediate_size=48)
# gpt-oss's experts: biases (the router's too), clamped quick-GeGLU with the +1 offset
GPT_OSS = dict(add_bias_linear=True, activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=0.05)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        dict(moe_grouped_gemm=True),
        SHARED,
        dict(SHARED, moe_shared_expert_gate=True, add_bias_linear=False),
        GPT_OSS,
        dict(GPT_OSS, moe_grouped_gemm=True),
    ],
)
def test_layer_output_and_gradients_against_direct(extra):
    cfg = _cfg(**extra)
    _, layer, x, seq = _run_layer(cfg)
    with torch.no_grad():  # non-zero biases (drawn 0)
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    out = layer(x, seq)
    direct = _direct_layer(layer, x, cfg)
    torch.testing.assert_close(out, direct, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    params = [x] + list(layer.parameters())
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(direct, params, g)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)


def test_grouped_gemm_equals_the_loop():
    torch.manual_seed(0)
    outs = []
    for grouped in (False, True):
        cfg = _cfg(moe_grouped_gemm=grouped, moe_router_topk=3)
        _, layer, x, seq = _run_layer(cfg)
        out = layer(x, seq)
        out.square().sum().backward()
        outs.append([out] + [p.grad for p in layer.parameters()])
    for a, w in zip(*outs):
        torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-7)


def _direct_switch(scores, routing_map, cfg, tokens):
    f = routing_map.double().sum(0)
    p = scores.double().sum(0)
    return E * cfg.moe_aux_loss_coeff / (cfg.moe_router_topk * tokens**2) * (p * f).sum()


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_balancing_losses_against_direct(kind):
    cfg = _cfg(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    _, layer, x, seq = _run_layer(cfg)
    layer(x, seq)
    s, b, h = x.shape
    logits = (x.reshape(-1, h) @ layer.router.weight.t()).detach().double()
    scores = torch.softmax(logits, -1)
    top = scores.topk(cfg.moe_router_topk, -1)[1]
    routing_map = torch.zeros_like(scores).scatter(1, top, 1)
    if kind == "seq_aux_loss":  # per sample: tokens j of sample i are rows j * b + i
        want = sum(_direct_switch(scores[i::b], routing_map[i::b], cfg, s) for i in range(b)) / b
        name = "seq_load_balancing_loss"
    else:
        want = _direct_switch(scores, routing_map, cfg, s * b)
        name = "global_load_balancing_loss" if kind == "global_aux_loss" else "load_balancing_loss"
    got = layer.router.last_losses
    assert abs(got[name].item() - want.item()) < 1e-6 * max(1.0, want.item())
    z = 0.01 * (torch.logsumexp(logits, -1) ** 2).mean()
    assert abs(got["z_loss"].item() - z.item()) < 1e-6 * z.item()


def test_losses_join_the_gradient_not_the_loss():
    """model(...) returns the cross entropy; its backward is that of cross entropy + every share."""
    cfg = _cfg(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    model = ReferenceGPT(cfg)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, tokens)
    model.zero_grad()
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    plain = ReferenceGPT(_cfg())
    plain.load_state_dict(model.state_dict())
    logits = plain(tokens)  # no labels: no losses attached
    ce = F.cross_entropy(logits.reshape(-1, 97).float(), tokens.reshape(-1))
    assert abs(ce.item() - loss.item()) < 1e-6
    total = ce
    seq_losses = {}

    def hook(module, inputs, output):
        seq_losses.update(inputs[1].moe_losses)

    handles = [blk.mlp.register_forward_hook(hook) for blk in model.layers]
    model.zero_grad()
    seq_losses.clear()
    logits = model(tokens)
    for h in handles:
        h.remove()
    total = F.cross_entropy(logits.reshape(-1, 97).float(), tokens.reshape(-1)) + sum(seq_losses.values())
    assert len(seq_losses) == 2 * cfg.num_layers
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drops_per_sample(policy, pad):
    cfg = _cfg(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)
    _, layer, x, seq = _run_layer(cfg)
    s, b, h = x.shape
    cap = math.ceil(s * cfg.moe_router_topk / E * 0.5)
    assert capacity_mod.capacity(cfg, s) == cap == 2
    logits = (x.reshape(-1, h) @ layer.router.weight.t()).detach()
    probs, routing_map = topk_routing(logits, cfg)
    got_probs, got_map = capacity_mod.apply_capacity(cfg, probs, routing_map, seq, layer.router.stats)
    for i in range(b):  # sample i: rows j * b + i, position j
        for e in range(E):
            rows = [j * b + i for j in range(s)]
            key = (
                (lambda r: (-probs[r, e].item(), r)) if policy == "probs" else (lambda r: (-int(routing_map[r, e]), r))
            )
            kept = sorted(rows, key=key)[:cap]
            want = [r in kept and (pad or bool(routing_map[r, e])) for r in rows]
            assert got_map[rows, e].tolist() == want
            assert torch.equal(got_probs[rows, e], probs[rows, e] * got_map[rows, e])
    out = layer(x, seq)
    keep = [set(got_map[t].nonzero().flatten().tolist()) for t in range(s * b)]
    if not pad:
        torch.testing.assert_close(out, _direct_layer(layer, x, cfg, keep), rtol=1e-5, atol=1e-6)


def test_moe_layer_freq():
    cfg = _cfg(num_layers=4, moe_layer_freq=2)
    model = ReferenceGPT(cfg)
    kinds = [type(block.mlp).__name__ for block in model.layers]
    assert kinds == ["MoELayer", "MLP", "MoELayer", "MLP"]
    cfg = _cfg(num_layers=4, moe_layer_freq=(0, 1, 1, 0))
    assert [type(b.mlp).__name__ for b in ReferenceGPT(cfg).layers] == ["MLP", "MoELayer", "MoELayer", "MLP"]
    assert cfg.num_moe_layers() == 2


REFUSALS = [
    (dict(num_experts=6, expert_model_parallel_size=4), "divisible by expert_model_parallel_size"),
    (dict(moe_router_topk=9), "must not exceed num_experts"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "group-limited routing needs"),
    (dict(moe_router_num_groups=4), "go together"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=4), "more than the 2"),
    (dict(moe_pad_expert_input_to_capacity=True), "need moe_expert_capacity_factor"),
    (dict(moe_token_drop_policy="position"), "need moe_expert_capacity_factor"),
    (dict(num_experts=None, moe_expert_capacity_factor=1.0), "needs num_experts"),
    (dict(num_experts=None, expert_model_parallel_size=2), "needs num_experts"),
    (dict(num_experts=None, moe_shared_expert_intermediate_size=64), "needs num_experts"),
    (dict(moe_shared_expert_gate=True), "it needs moe_shared_expert_intermediate_size"),
    (dict(moe_shared_expert_gate=True, moe_shared_expert_intermediate_size=64, add_bias_linear=True), "--disable-bias"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01), "moe_aux_loss_coeff must be 0"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_router_score_function="sigmoid"), "chooses and weighs"),
    (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps is not implemented"),
    (dict(moe_token_dispatcher_type="flex"), "needs DeepEP"),
    (dict(moe_router_enable_expert_bias=True), "needs moe_router_score_function sigmoid"),
    (dict(moe_layer_freq=(1, 0, 1)), "0 or 1 for each of the 2 layers"),
    (dict(tensor_model_parallel_size=2), "needs sequence_parallel"),
]


@pytest.mark.parametrize("extra,needle", REFUSALS)
def test_refusals(extra, needle):
    with pytest.raises(ValueError, match=needle) as err:
        _cfg(**extra)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")
