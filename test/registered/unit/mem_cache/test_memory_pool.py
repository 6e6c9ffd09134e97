"""ReqToTokenPool and token→KV pools: shapes, exact bytes, round trips, meta-device builds."""

SUITE = "unit-cpu"
EST_TIME = 5

import pytest
import torch

from sglite.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


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
