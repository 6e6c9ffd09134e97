"""ReqToTokenPool, token→KV pools and the DFLASH deferred context rows: shapes, exact bytes, round trips, meta builds."""

SUITE = "unit-cpu"
EST_TIME = 8

import pytest
import torch

from sglite.srt.mem_cache.memory_pool import DeferredContextRows, MHATokenToKVPool, ReqToTokenPool


def test_req_to_token_pool_rows():
    p = ReqToTokenPool(size=3, max_context_len=10, device="cpu")
    assert tuple(p.req_to_token.shape) == (4, 10)
    assert p.req_to_token.dtype == torch.int32
    rows = p.alloc(2)
    assert rows is not None and 0 not in rows and len(set(rows)) == 2
    assert p.alloc(2) is None
    assert p.available_size() == 1
    p.write(rows[0], 2, torch.tensor([7, 8, 9]))
    assert p.req_to_token[rows[0], 2:5].tolist() == [7, 8, 9]
    p.free(rows[0])
    with pytest.raises(ValueError):
        p.free(rows[0])
    with pytest.raises(ValueError):
        p.free(0)
    assert p.available_size() == 2
    assert p.nbytes() == 4 * 10 * 4 == ReqToTokenPool.planned_bytes(3, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mha_pool_shapes_bytes_and_roundtrip(dtype, page_size):
    size, heads, hd, vhd, layers = 32, 2, 8, 4, 3
    p = MHATokenToKVPool(size, page_size, dtype, heads, hd, vhd, layers, "cpu")
    assert len(p.k_buffer) == layers
    assert tuple(p.get_key_buffer(0).shape) == (size + page_size, heads, hd)
    assert tuple(p.get_value_buffer(2).shape) == (size + page_size, heads, vhd)
    assert p.get_key_buffer(1).dtype == dtype
    elem = torch.tensor([], dtype=dtype).element_size()
    expect = (size + page_size) * heads * (hd + vhd) * layers * elem
    assert p.nbytes() == expect
    assert MHATokenToKVPool.planned_bytes(size, page_size, dtype, heads, hd, vhd, layers) == expect
    loc = torch.tensor([page_size, page_size + 5])
    k = torch.randn(2, heads * hd)
    v = torch.randn(2, heads, vhd)
    p.set_kv_buffer(1, loc, k, v)
    got_k = p.get_key_buffer(1)[loc].float()
    assert torch.equal(got_k, k.reshape(2, heads, hd).to(dtype).float())
    assert torch.equal(p.get_value_buffer(1)[loc].float(), v.to(dtype).float())
    assert p.get_key_buffer(0)[loc].float().abs().sum() == 0  # other layers untouched


def test_mha_pool_on_meta_has_same_bytes():
    args = (4096, 64, torch.bfloat16, 8, 128, 128, 36)
    p = MHATokenToKVPool(*args, "meta")
    assert p.get_key_buffer(0).device.type == "meta"
    assert p.nbytes() == MHATokenToKVPool.planned_bytes(*args)


def test_mha_pool_subset_of_model_layers():
    p = MHATokenToKVPool(8, 1, torch.float32, 1, 4, 4, 2, "cpu", layer_ids=[3, 7])
    assert p.get_key_buffer(7).shape[0] == 9
    with pytest.raises(KeyError, match="layer 0"):
        p.get_key_buffer(0)


# ---------------------------------------------------------------- MLA, SWA pair, hybrid linear
from sglite.srt.mem_cache.allocator import SWATokenToKVPoolAllocator  # noqa: E402
from sglite.srt.mem_cache.memory_pool import (  # noqa: E402
    HybridLinearKVPool,
    MambaStatePool,
    MLATokenToKVPool,
    SWAKVPool,
)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_mla_pool_bytes_and_layout(device):
    p = MLATokenToKVPool(64, 16, torch.bfloat16, 512, 64, 3, device)
    assert p.nbytes() == (64 + 16) * 576 * 3 * 2 == MLATokenToKVPool.planned_bytes(64, 16, torch.bfloat16, 512, 64, 3)
    assert tuple(p.get_key_buffer(2).shape) == (80, 1, 576)
    assert tuple(p.get_value_buffer(2).shape) == (80, 1, 512)


def test_mla_pool_roundtrip():
    p = MLATokenToKVPool(8, 1, torch.float32, 6, 2, 1, "cpu")
    loc = torch.tensor([3])
    nope, rope = torch.randn(1, 6), torch.randn(1, 2)
    p.set_mla_kv_buffer(0, loc, nope, rope)
    assert torch.equal(p.get_key_buffer(0)[3, 0], torch.cat([nope[0], rope[0]]))
    assert torch.equal(p.get_value_buffer(0)[3, 0], nope[0])


def _swa(device="cpu", full=32, swa=16, page=4):
    return SWAKVPool(
        full, swa, page, torch.float32,
        2, 8, 8, [1, 3],  # full layers
        1, 4, 4, [0, 2],  # sliding layers (their own head count and dim)
        device,
    )


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_swa_pool_bytes(device):
    p = _swa(device)
    planned = SWAKVPool.planned_bytes(32, 16, 4, torch.float32, 2, 8, 8, 2, 1, 4, 4, 2)
    assert p.part_nbytes() == planned
    assert planned["full"] == 36 * 2 * 16 * 2 * 4
    assert planned["swa"] == 20 * 1 * 8 * 2 * 4
    assert planned["mapping"] == 36 * 8
    assert p.nbytes() == sum(planned.values())


def test_swa_allocator_maps_full_slots_to_sliding_slots():
    p = _swa(page=1, full=8, swa=4)
    a = SWATokenToKVPoolAllocator(8, 4, 1, "cpu", p.full_to_swa_index_mapping)
    full = a.alloc(3)
    swa = p.translate_loc_to_swa(full)
    assert (swa >= 1).all() and (swa < 5).all() and swa.unique().numel() == 3
    k = torch.randn(3, 1, 4)
    p.set_kv_buffer(0, full, k, k)  # sliding layer: written at the sliding slots
    assert torch.equal(p.get_key_buffer(0)[swa], k)
    kf = torch.randn(3, 2, 8)
    p.set_kv_buffer(1, full, kf, kf)  # full layer: written at the full slots
    assert torch.equal(p.get_key_buffer(1)[full], kf)
    assert a.available_size() == 1  # sliding pool is the limit
    assert a.alloc(2) is None and a.full_available_size() == 5  # failed alloc gave back its full slots
    a.free_swa(full[:2])  # two tokens left the window
    assert a.swa_available_size() == 3 and a.full_available_size() == 5
    assert p.translate_loc_to_swa(full[:2]).tolist() == [0, 0]
    a.free(full)
    assert a.full_available_size() == 8 and a.swa_available_size() == 4


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_hybrid_linear_pool_bytes(device):
    kv = MHATokenToKVPool(16, 1, torch.bfloat16, 2, 8, 8, 1, device, layer_ids=[3])
    st = MambaStatePool(4, [0, 1, 2], 2, 8, 8, 12, 4, torch.float32, torch.bfloat16, device)
    pool = HybridLinearKVPool(kv, st)
    per_slot = MambaStatePool.bytes_per_slot(3, 2, 8, 8, 12, 4, torch.float32, torch.bfloat16)
    assert per_slot == 3 * (2 * 8 * 8 * 4 + 12 * 3 * 2)
    assert st.nbytes() == 5 * per_slot == MambaStatePool.planned_bytes(4, 3, 2, 8, 8, 12, 4, torch.float32, torch.bfloat16)
    assert pool.nbytes() == kv.nbytes() + st.nbytes()
    assert pool.get_key_buffer(3).shape[0] == 17
    with pytest.raises(ValueError):
        HybridLinearKVPool(MHATokenToKVPool(16, 1, torch.bfloat16, 2, 8, 8, 1, device, layer_ids=[0]), st)


def test_swa_allocator_extend_keeps_page_offsets_in_both_pools():
    p = _swa(page=4, full=32, swa=16)
    a = SWATokenToKVPoolAllocator(32, 16, 4, "cpu", p.full_to_swa_index_mapping)
    first = a.alloc_extend([0], [6], [-1])
    swa = p.translate_loc_to_swa(first)
    assert (first % 4).tolist() == (swa % 4).tolist() == [0, 1, 2, 3, 0, 1]
    nxt = a.alloc_extend([6], [7], [int(first[-1])])  # fills the tail of the last page in both pools
    assert int(nxt[0]) == int(first[-1]) + 1
    assert int(p.translate_loc_to_swa(nxt)[0]) == int(swa[-1]) + 1
    dec = a.alloc_decode([8], [int(nxt[0])])
    assert int(dec[0]) == int(nxt[0]) + 1
    a.free(torch.cat([first, nxt, dec]))
    assert a.full_available_size() == 32 and a.swa_available_size() == 16


def test_mha_pool_writes_equal_for_int64_and_int32_slots_and_strided_rows():
    """int64 slots take index_copy_, others advanced indexing; a strided K (a slice of a fused q/k tensor) is fine."""
    heads, hd = 2, 8
    pools = [MHATokenToKVPool(16, 1, torch.float32, heads, hd, hd, 1, "cpu") for _ in range(2)]
    qk = torch.randn(3, 3 * heads, hd)
    k = qk[:, heads:2 * heads]  # non-contiguous [3, heads, hd] view
    v = torch.randn(3, heads * hd)
    for pool, dtype in zip(pools, (torch.int64, torch.int32)):
        pool.set_kv_buffer(0, torch.tensor([4, 1, 9], dtype=dtype), k, v)
    assert torch.equal(pools[0].get_key_buffer(0), pools[1].get_key_buffer(0))
    assert torch.equal(pools[0].get_value_buffer(0), pools[1].get_value_buffer(0))
    assert torch.equal(pools[0].get_key_buffer(0)[torch.tensor([4, 1, 9])], k)
    assert pools[0].get_key_buffer(0)[0].abs().sum() == 0  # untouched slot


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_context_rows_bytes(device, dtype):
    buf = DeferredContextRows(256, 4 * 576, dtype, device)
    elem = torch.tensor([], dtype=dtype).element_size()
    # features [rows, width] in the runtime dtype, positions and slots int64
    assert buf.nbytes() == 256 * (4 * 576 * elem + 8 + 8) == DeferredContextRows.planned_bytes(256, 4 * 576, dtype)
    assert buf.features.device.type == device and buf.slots.dtype == buf.positions.dtype == torch.int64


def test_deferred_context_rows_append_in_order_never_grow_and_clear():
    buf = DeferredContextRows(5, 3, torch.float32, "cpu")
    storage = buf.features.data_ptr()
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.arange(6, 15, dtype=torch.float32).reshape(3, 3)
    buf.append(a, torch.tensor([10, 11]), torch.tensor([100, 101], dtype=torch.int32))
    # A strided source (a decode step's first block slot per request) is copied row by row.
    wide = torch.tensor([[7, 102, 0], [8, 103, 0], [9, 104, 0]])
    buf.append(b, wide[:, 0], wide[:, 1])
    assert buf.size == 5 and buf.free_rows == 0
    feats, pos, slots = buf.pending()
    assert torch.equal(feats, torch.cat([a, b])) and pos.tolist() == [10, 11, 7, 8, 9]
    assert slots.tolist() == [100, 101, 102, 103, 104] and slots.dtype == torch.int64
    with pytest.raises(ValueError, match="flush first"):
        buf.append(a[:1], torch.tensor([1]), torch.tensor([1]))
    buf.clear()
    assert buf.size == 0 and buf.pending()[0].shape == (0, 3)
    buf.append(b, torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]))
    assert torch.equal(buf.pending()[0], b) and buf.features.data_ptr() == storage


def test_deferred_context_rows_refuse_what_the_plan_did_not_price():
    buf = DeferredContextRows(4, 3, torch.float32, "cpu")
    with pytest.raises(ValueError, match="bfloat16"):
        buf.append(torch.zeros(1, 3, dtype=torch.bfloat16), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"expected \[1, 3\]"):
        buf.append(torch.zeros(1, 4), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows >= 1"):
        DeferredContextRows(0, 3, torch.float32, "cpu")
