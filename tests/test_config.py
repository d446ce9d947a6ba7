"""GPTConfig validation, parallel_state's rank grid and group roles, and the Philox generator's known answers."""

import pytest
import torch

from megatron_sp import parallel_state
from megatron_sp.config import GPTConfig
from megatron_sp.ops import philox

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=97, seq_length=32)


@pytest.mark.parametrize(
    "override,field",
    [
        (dict(hidden_size=66), "hidden_size"),
        (dict(tensor_model_parallel_size=8), "num_attention_heads"),
        (dict(tensor_model_parallel_size=2, ffn_hidden_size=255), "ffn_hidden_size"),
        (
            dict(tensor_model_parallel_size=4, sequence_parallel=True, seq_length=34, max_position_embeddings=64),
            "seq_length",
        ),
        (dict(num_layers=0), "num_layers"),
        (dict(vocab_size=-3), "vocab_size"),
        (dict(hidden_dropout=1.0), "hidden_dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(max_position_embeddings=16), "max_position_embeddings"),
        (dict(tensor_model_parallel_size=2, tp_comm_overlap=True), "tp_comm_overlap"),  # without SP
        (  # 34 tokens cannot be cut into the ring's 4 chunks (SP's shards): SP's own refusal
            dict(
                tensor_model_parallel_size=4,
                sequence_parallel=True,
                tp_comm_overlap=True,
                seq_length=34,
                max_position_embeddings=64,
            ),
            "seq_length",
        ),
        # a2a+p2p never runs without its levels (Megatron-Bridge once turned CP off silently)
        (dict(context_parallel_size=4, cp_comm_type="a2a+p2p"), "cp_comm_type"),
        (dict(context_parallel_size=4, hierarchical_context_parallel_sizes=(2, 3)), "hierarchical"),
        (dict(context_parallel_size=2, cp_comm_type=("p2p", "a2a", "p2p")), "cp_comm_type"),  # 2 layers
        (dict(context_parallel_size=2, cp_comm_type=("p2p", "ring")), "cp_comm_type"),
        (dict(context_parallel_size=4, cp_comm_type="a2a", num_attention_heads=2, hidden_size=64), "num_attention"),
        (dict(context_parallel_size=2, cp_comm_type=("a2a", "allgather"), seq_length=34), "seq_length"),  # zigzag
        (dict(window_size=(8, 2)), "window_size"),  # a causal decoder
        (dict(window_size=(-2, 0)), "window_size"),
        (dict(window_attn_skip_freq=2), "window_attn_skip_freq"),  # without a window
        (dict(window_size=(8, 0), window_attn_skip_freq=(1, 0, 1)), "window_attn_skip_freq"),
        (dict(softmax_type="sigmoid"), "softmax_type"),
        (dict(glu_linear_offset=1.0), "glu_linear_offset"),  # GPT-2's GELU is not gated
        (dict(activation="swiglu", activation_func_clamp_value=7.0), "activation_func_clamp_value"),  # MoE's
        (dict(activation="quick_geglu", activation_func_clamp_value=float("inf")), "activation_func_clamp_value"),
        (dict(position_embedding_type="yarn", rotary_percent=0.5), "position_embedding_type"),
        (dict(position_embedding_type="yarn", yarn_beta_fast=0.5), "yarn_beta_fast"),
        (dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=0.0), "yarn_rotary_scaling_factor"),
    ],
)
def test_config_rejects_with_the_field_named(override, field):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**{**BASE, **override})


def test_per_layer_options_read_as_megatron_reads_them():
    """--window-attn-skip-freq N: every N-th layer (1-based) full; a pattern: 1 = windowed; --window-size
    -1: no limit; --cp-comm-type: one value or one per layer; the flags' words parsed as Megatron's."""
    from megatron_sp.layer_options import cp_comm_types, layer_freq_type, layer_window, window_size_type, zigzag_split

    four = dict(BASE, num_layers=4)
    every_third = GPTConfig(**four, window_size=(16, 0), window_attn_skip_freq=3)
    assert [layer_window(every_third, n) for n in range(1, 5)] == [16, 16, None, 16]
    pattern = GPTConfig(**four, window_size=(16, 0), window_attn_skip_freq=layer_freq_type("([1]*1+[0])*2"))
    assert pattern.window_attn_skip_freq == (1, 0, 1, 0)
    assert [layer_window(pattern, n) for n in range(1, 5)] == [16, None, 16, None]
    assert layer_window(GPTConfig(**four, window_size=window_size_type("(-1, 0)")), 1) is None
    assert window_size_type("4096,0") == (4096, 0)
    mixed = GPTConfig(**four, context_parallel_size=4, cp_comm_type=["a2a", "a2a+p2p", "allgather", "p2p"],
                      hierarchical_context_parallel_sizes=[2, 2])  # fmt: skip
    assert cp_comm_types(mixed) == ("a2a", "a2a+p2p", "allgather", "p2p") and zigzag_split(mixed)
    one = GPTConfig(**BASE, context_parallel_size=2, cp_comm_type=["a2a"])  # --cp-comm-type a2a
    assert one.cp_comm_type == "a2a" and not zigzag_split(one)


def test_sequence_parallel_without_tp_is_a_warned_no_op():
    with pytest.warns(UserWarning, match="sequence_parallel"):
        cfg = GPTConfig(**BASE, sequence_parallel=True)
    assert cfg.sequence_parallel is False


def test_a_saved_overlapped_config_rebuilds_serially():
    """Checkpoint tools rebuild the serial model from a saved config: --tp-comm-overlap goes with SP."""
    import dataclasses

    from megatron_sp.config import config_from_dict

    saved = GPTConfig(**BASE, tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True)
    serial = config_from_dict(dataclasses.asdict(saved))
    assert (serial.tensor_model_parallel_size, serial.sequence_parallel, serial.tp_comm_overlap) == (1, False, False)


def test_defaults_follow_megatron():
    cfg = GPTConfig(**BASE)
    assert (cfg.hidden_dropout, cfg.attention_dropout, cfg.seed, cfg.sequence_parallel) == (0.1, 0.1, 1234, False)
    assert cfg.ffn_hidden_size == 4 * cfg.hidden_size
    assert GPTConfig(**BASE, tensor_model_parallel_size=4).padded_vocab_size == 512  # multiple of 128 × t


def test_rank_grid_is_tp_fastest_and_partitions_the_world():
    tp, cp, dp, dp_cp = parallel_state.grid_ranks(tp_size=2, cp_size=2, dp_size=2)
    assert tp[0] == [0, 1] and cp[0] == [0, 2] and dp[0] == [0, 4]
    for groups in (tp, cp, dp, dp_cp):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_hierarchical_cp_groups_under_tp():
    """a2a+p2p 2 × 2 at TP2 × CP4 (8 ranks, more than the parity worlds hold): each a2a group is two
    adjacent CP ranks of one TP rank, each ring the ranks at one place of their a2a groups, by group,
    so CP rank g·A + i is outer rank g (hierarchical.py's zigzag argument)."""
    cp_lists = parallel_state.grid_ranks(tp_size=2, cp_size=4, dp_size=1)[1]
    assert cp_lists == [[0, 2, 4, 6], [1, 3, 5, 7]]
    inner, outer = parallel_state.hierarchical_cp_ranks(cp_lists, (2, 2))
    assert inner == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert outer == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_group_roles_name_the_replicas_and_the_tensor_shards():
    """ "replicas" is DP×CP (its rank is the place in grid_ranks' DP×CP group), "tp" the TP axis; a
    parameter's replica role is its mark, DP×CP unless it carries another."""
    ps = parallel_state.ParallelState(tp_size=2, cp_size=2, dp_size=2, tp_rank=1, cp_rank=1, dp_rank=1)
    assert (ps.replicas, ps.size("replicas"), ps.size("tp"), ps.rank("tp")) == (4, 4, 2, 1)
    me = 1 + 2 * (1 + 2 * 1)  # global rank of (tp 1, cp 1, dp 1)
    (mine,) = [g for g in parallel_state.grid_ranks(2, 2, 2)[3] if me in g]
    assert ps.rank("replicas") == ps.replica_rank == mine.index(me)
    assert parallel_state.ParallelState().replica_group is None  # one replica: nothing to reduce over
    assert (ps.size("ep"), ps.size("expert_tp"), ps.size("expert_replicas"), ps.group("ep")) == (1, 1, 1, None)
    with pytest.raises(ValueError, match="unknown process-group role 'bogus'"):
        ps.group("bogus")
    param = torch.nn.Parameter(torch.zeros(2))
    assert parallel_state.replica_role(param) == parallel_state.REPLICAS
    param.replica_role = "expert_replicas"
    assert parallel_state.replica_role(param) == "expert_replicas"


def test_a_gradient_bucket_holds_one_replica_group():
    """Parameters of two replica roles never share a bucket (each bucket is reduced over one group);
    with one role the buckets are the runs they always were."""
    from megatron_sp.distributed.grad_buffers import GradBuffers

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    before = [[tuple(p.shape) for p in b.params] for b in GradBuffers(model, bucket_bytes=1 << 20).buckets]
    assert before == [[(4,), (4, 4), (4,), (4, 4), (4,), (4, 4)]]
    for p in model[1].parameters():
        p.replica_role = "expert_replicas"
    buckets = GradBuffers(model, bucket_bytes=1 << 20).buckets
    assert [(b.role, len(b.params)) for b in buckets] == [("replicas", 4), ("expert_replicas", 2)]
    assert {id(p) for p in buckets[1].params} == {id(p) for p in model[1].parameters()}


def test_world_that_does_not_factor_is_a_value_error():
    with pytest.raises(ValueError, match="not divisible"):
        parallel_state._check_factors(6, tp=4, cp=1)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)  # no process group: world 1


def test_philox_known_answers():
    """Random123's published Philox4x32-10 test vectors."""
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    out = philox.philox4x32(t(0x243F6A88), t(0x85A308D3), t(0x13198A2E), t(0x03707344), 0xA4093822, 0x299F31D0)
    assert [int(w) for w in out] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]
    out = philox.philox4x32(t(0), t(0), t(0), t(0), 0, 0)
    assert [int(w) for w in out] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_dropout_rate_and_shard_invariance():
    index = philox.default_index(64, 4)
    keep = philox.hidden_keep_mask((64, 4, 96), 0.25, 1234, 3, philox.SITE_MLP_OUT, index)
    assert abs(1 - keep.float().mean().item() - 0.25) < 0.02
    shard = philox.DropoutIndex(torch.arange(16, 32), torch.arange(4))  # rows 16..31, features 48..95
    part = philox.hidden_keep_mask((16, 4, 48), 0.25, 1234, 3, philox.SITE_MLP_OUT, shard, feature_offset=48)
    assert torch.equal(part, keep[16:32, :, 48:])
