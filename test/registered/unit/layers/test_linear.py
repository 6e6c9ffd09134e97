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


def assert_same_dot_products(got, want, x, w, b=None):
    """got == want up to summation order: each is x @ w.T (+ b) summed in some fp32 order.

    Any order of K products (+ bias) errs by at most K * 2^-24 * sum|terms| (Higham's gamma_K), so
    two orders differ by at most twice that; BLAS kernels pick the order by shape and CPU ISA.
    """
    terms = x.abs() @ w.abs().t() + (0 if b is None else b.abs())
    bound = 2 * (x.shape[-1] + 1) * 2.0**-24 * terms
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, max bound-excess {(err - bound).max():.3g}"


def test_tp1_layers_equal_plain_linear():
    x, w, b = rand(5, 16), rand(24, 16, seed=1), rand(24, seed=2)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(16, 24, bias=True, params_dtype=torch.float32, tp_group=group(0, 1))
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        torch.testing.assert_close(layer.weight, w, rtol=0, atol=0)
        # Not bit-equal: the CPU weight layout (column-major) sends MKL down another summation order.
        assert_same_dot_products(layer(x), F.linear(x, w, b), x, w, b)
    rep = ReplicatedLinear(16, 24, bias=False, params_dtype=torch.float32)
    rep.weight.weight_loader(rep.weight, w)
    torch.testing.assert_close(rep.weight, w, rtol=0, atol=0)
    assert_same_dot_products(rep(x), F.linear(x, w), x, w)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_shards_reassemble(tp):
    x, w, b = rand(3, 16), rand(32, 16, seed=1), rand(32, seed=2)
    cols = []
    for r in range(tp):
        layer = ColumnParallelLinear(16, 32, bias=True, params_dtype=torch.float32, tp_group=group(r, tp))
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        cols.append(F.linear(x, layer.weight, layer.bias))
    assert_same_dot_products(torch.cat(cols, -1), F.linear(x, w, b), x, w, b)

    x2, w2 = rand(3, 32, seed=3), rand(16, 32, seed=4)
    partial = torch.zeros(3, 16)
    for r in range(tp):
        layer = RowParallelLinear(32, 16, bias=False, params_dtype=torch.float32, tp_group=group(r, tp))
        layer.weight.weight_loader(layer.weight, w2)
        n = 32 // tp
        partial += F.linear(x2[:, r * n : (r + 1) * n], layer.weight)
    assert_same_dot_products(partial, F.linear(x2, w2), x2, w2)  # tp partial sums: one more summation order


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
    assert_same_dot_products(torch.cat(gates, -1), F.linear(x, gate), x, gate)
    assert_same_dot_products(torch.cat(ups, -1), F.linear(x, up), x, up)


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
        rows = slice(kv_head * hd, (kv_head + 1) * hd)
        assert_same_dot_products(k[:, :hd], k_full[:, rows], x, wk[rows], bk[rows])
        assert_same_dot_products(v[:, :hd], v_full[:, rows], x, wv[rows], bv[rows])
    assert_same_dot_products(torch.cat(qs, -1), q_full, x, wq, bq)


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
