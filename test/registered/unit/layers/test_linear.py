"""TP linear layers: rank shards loaded from full tensors reassemble the full projection exactly."""

import pytest
import torch
import torch.nn.functional as F

from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglite.srt.layers.utils import WeightShapeError

SUITE = "unit-cpu"
EST_TIME = 3


def group(rank: int, size: int) -> GroupCoordinator:
    """A group seen from one rank; loaders need no collectives, so a placeholder process group suffices."""
    return GroupCoordinator(list(range(size)), rank, "tp", device_group=None if size == 1 else object())


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_tp1_layers_equal_plain_linear():
    x, w, b = rand(5, 16), rand(24, 16, seed=1), rand(24, seed=2)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(16, 24, bias=True, params_dtype=torch.float32, tp_group=group(0, 1))
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=0, atol=0)
    rep = ReplicatedLinear(16, 24, bias=False, params_dtype=torch.float32)
    rep.weight.weight_loader(rep.weight, w)
    torch.testing.assert_close(rep(x), F.linear(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_shards_reassemble(tp):
    x, w, b = rand(3, 16), rand(32, 16, seed=1), rand(32, seed=2)
    cols = []
    for r in range(tp):
        layer = ColumnParallelLinear(16, 32, bias=True, params_dtype=torch.float32, tp_group=group(r, tp))
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        cols.append(F.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(torch.cat(cols, -1), F.linear(x, w, b), rtol=1e-6, atol=1e-6)

    x2, w2 = rand(3, 32, seed=3), rand(16, 32, seed=4)
    partial = torch.zeros(3, 16)
    for r in range(tp):
        layer = RowParallelLinear(32, 16, bias=False, params_dtype=torch.float32, tp_group=group(r, tp))
        layer.weight.weight_loader(layer.weight, w2)
        n = 32 // tp
        partial += F.linear(x2[:, r * n : (r + 1) * n], layer.weight)
    torch.testing.assert_close(partial, F.linear(x2, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_gate_up_shards(tp):
    x, gate, up = rand(4, 8), rand(12, 8, seed=1), rand(12, 8, seed=2)
    gates, ups = [], []
    for r in range(tp):
        layer = MergedColumnParallelLinear(8, [12, 12], bias=False, params_dtype=torch.float32, tp_group=group(r, tp))
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g, u = F.linear(x, layer.weight).chunk(2, dim=-1)
        gates.append(g)
        ups.append(u)
    torch.testing.assert_close(torch.cat(gates, -1), F.linear(x, gate), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(ups, -1), F.linear(x, up), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp,kv_heads,expect_local_kv", [(1, 2, 2), (2, 2, 1), (4, 2, 1), (2, 4, 2)])
def test_qkv_shards_and_kv_replication(tp, kv_heads, expect_local_kv):
    heads, hd, hidden = 4, 8, 16
    x = rand(3, hidden)
    wq, wk, wv = rand(heads * hd, hidden, seed=1), rand(kv_heads * hd, hidden, seed=2), rand(kv_heads * hd, hidden, seed=3)
    bq, bk, bv = rand(heads * hd, seed=4), rand(kv_heads * hd, seed=5), rand(kv_heads * hd, seed=6)
    q_full, k_full, v_full = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)
    qs = []
    for r in range(tp):
        layer = QKVParallelLinear(hidden, hd, heads, kv_heads, bias=True, params_dtype=torch.float32, tp_group=group(r, tp))
        assert layer.num_kv_heads == expect_local_kv
        for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight.weight_loader(layer.weight, w, sid)
            layer.bias.weight_loader(layer.bias, b, sid)
        q, k, v = layer.split_qkv(layer(x))
        qs.append(q)
        # Query head h of this rank uses KV head (global q head) // (heads // kv_heads).
        first_q_head = r * layer.num_heads
        kv_head = first_q_head // (heads // kv_heads)
        torch.testing.assert_close(k[:, :hd], k_full[:, kv_head * hd : (kv_head + 1) * hd], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v[:, :hd], v_full[:, kv_head * hd : (kv_head + 1) * hd], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(qs, -1), q_full, rtol=1e-6, atol=1e-6)


def test_misshaped_tensors_are_clear_errors():
    layer = QKVParallelLinear(16, 8, 4, 2, bias=False, params_dtype=torch.float32, tp_group=group(0, 1))
    with pytest.raises(WeightShapeError, match=r"k_proj.*\(8, 16\).*\(16, 16\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 16), "k")
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 16), "x")
    row = RowParallelLinear(16, 8, bias=False, params_dtype=torch.float32, tp_group=group(0, 1))
    with pytest.raises(WeightShapeError, match="RowParallelLinear"):
        row.weight.weight_loader(row.weight, torch.zeros(16, 8))


def test_indivisible_sizes_name_the_quantity():
    with pytest.raises(ValueError, match="num_attention_heads = 6 is not divisible by the tensor-parallel size 4"):
        QKVParallelLinear(16, 8, 6, 2, tp_group=group(0, 4))
