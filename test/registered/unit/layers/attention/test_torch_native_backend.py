"""torch_native attention (the reference) against plain SDPA on unpaged K/V; registry and layer checks."""

SUITE = "unit-cpu"
EST_TIME = 20

from types import SimpleNamespace

import pytest
import torch

from attention_cases import build_case, dense_reference, run_backend
from sglite.srt.layers.attention.radix_attention import RadixAttention
from sglite.srt.layers.attention.registry import AttentionBackendError, create_attention_backend
from sglite.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglite.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK]


def _lens(mode: ForwardMode) -> tuple[list[int], list[int]]:
    if mode == ForwardMode.DECODE:
        return [0, 7, 33], [1, 1, 1]
    if mode == ForwardMode.EXTEND:
        return [0, 19, 3], [11, 5, 24]
    return [4, 30, 17], [4, 4, 4]  # VERIFY / DRAFT_BLOCK: one block size B for all


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_torch_native_equals_dense_sdpa(mode, page_size, sliding_window):
    prefix, extend = _lens(mode)
    case = build_case(
        mode, prefix, extend, page_size=page_size, num_kv_heads=2, group=4, head_dim=32, v_head_dim=16,
        sliding_window=sliding_window, seed=page_size,
    )
    out = run_backend(TorchNativeAttnBackend(), case)
    ref = dense_reference(case, causal=mode != ForwardMode.DRAFT_BLOCK)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_draft_block_is_non_causal_and_verify_is_causal():
    """Same inputs: the first query of a block differs between the modes, the last one does not."""
    outs = {}
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK):
        case = build_case(mode, [5], [4], page_size=1, num_kv_heads=1, group=2, head_dim=16, seed=3)
        outs[mode] = run_backend(TorchNativeAttnBackend(), case)
    verify, block = outs[ForwardMode.TARGET_VERIFY], outs[ForwardMode.DRAFT_BLOCK]
    assert not torch.allclose(verify[0], block[0])
    torch.testing.assert_close(verify[-1], block[-1])


def test_backend_writes_new_kv_into_pool():
    case = build_case(ForwardMode.EXTEND, [3, 0], [2, 5], page_size=16, num_kv_heads=2, group=1, head_dim=16)
    run_backend(TorchNativeAttnBackend(), case)
    pool, fb = case.forward_batch.token_to_kv_pool, case.forward_batch
    k_buf = pool.get_key_buffer(case.layer.layer_id)
    torch.testing.assert_close(k_buf[fb.out_cache_loc].reshape(case.k.shape), case.k)


def test_save_kv_cache_false_reads_what_the_pool_holds():
    case = build_case(ForwardMode.EXTEND, [3], [4], page_size=1, num_kv_heads=1, group=1, head_dim=16)
    ref = run_backend(TorchNativeAttnBackend(), case)  # writes the new K/V
    case.k = torch.zeros_like(case.k)  # ignored when save_kv_cache=False
    torch.testing.assert_close(run_backend(TorchNativeAttnBackend(), case, save_kv_cache=False), ref)


def test_idle_returns_empty_output():
    case = build_case(ForwardMode.EXTEND, [0], [2], page_size=1, num_kv_heads=1, group=2, head_dim=16)
    case.forward_batch.forward_mode = ForwardMode.IDLE
    empty = torch.empty(0, case.q.shape[1])
    backend = TorchNativeAttnBackend()
    case.forward_batch.attn_backend = backend
    backend.init_forward_metadata(case.forward_batch)
    out = case.layer(empty, empty[:, :16], empty[:, :16], case.forward_batch)
    assert out.shape == (0, case.layer.num_heads * case.layer.v_head_dim)


def test_forward_before_metadata_is_an_error():
    case = build_case(ForwardMode.EXTEND, [0], [2], page_size=1, num_kv_heads=1, group=1, head_dim=16)
    case.forward_batch.attn_backend = TorchNativeAttnBackend()
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        case.layer(case.q, case.k, case.v, case.forward_batch)


def test_registry_names_and_errors():
    runner = SimpleNamespace(device=torch.device("cpu"))
    assert isinstance(create_attention_backend("torch_native", runner), TorchNativeAttnBackend)
    with pytest.raises(AttentionBackendError, match="--attention-backend"):
        create_attention_backend("flashinfer", runner)
    with pytest.raises(AttentionBackendError, match="choose one of"):
        create_attention_backend("sdpa", runner)


def test_radix_attention_rejects_bad_geometry():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        RadixAttention(6, 16, 0.25, 4, layer_id=0)
    with pytest.raises(ValueError, match="sliding_window"):
        RadixAttention(4, 16, 0.25, 2, layer_id=0, sliding_window=0)
    layer = RadixAttention(8, 16, 0.25, 2, layer_id=3)
    assert layer.kv_group_size == 4 and layer.v_head_dim == 16


def _ragged_lens(mode: ForwardMode, bs: int, seed: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 40, (bs,), generator=gen).tolist()
    if mode == ForwardMode.DECODE:
        return prefix, [1] * bs
    if mode == ForwardMode.EXTEND:
        return prefix, torch.randint(1, 9, (bs,), generator=gen).tolist()
    return prefix, [3] * bs  # one block size for the whole batch


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bs", [1, 2, 7, 33])
def test_batched_ragged_batches_equal_dense_sdpa(mode, page_size, bs):
    """The padded one-call-per-layer path over ragged lengths, page sizes 1/16 and batch sizes 1..33."""
    prefix, extend = _ragged_lens(mode, bs, seed=bs)
    case = build_case(
        mode, prefix, extend, page_size=page_size, num_kv_heads=2, group=3, head_dim=16, seed=bs + page_size,
        sliding_window=5 if bs == 7 else None,
    )
    backend = TorchNativeAttnBackend()
    out = run_backend(backend, case)
    assert len(backend._groups) == 1 or mode == ForwardMode.EXTEND
    torch.testing.assert_close(out, dense_reference(case, causal=mode != ForwardMode.DRAFT_BLOCK), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
def test_ragged_batch_past_padding_limit_is_split_by_length(mode):
    """One long sequence among short ones: split into length groups (bounded padding), same result."""
    prefix = [0, 2, 90, 3, 1, 95, 2, 0, 4]
    extend = [60, 1, 2, 1, 2, 1, 1, 2, 1] if mode == ForwardMode.EXTEND else [1] * 9
    case = build_case(mode, prefix, extend, page_size=16, num_kv_heads=1, group=2, head_dim=16, sliding_window=50)
    backend = TorchNativeAttnBackend()
    out = run_backend(backend, case)
    groups = [g.members for g in backend._groups]
    assert len(groups) > 1 and sorted(i for g in groups for i in g) == list(range(9))
    torch.testing.assert_close(out, dense_reference(case, causal=True), atol=1e-5, rtol=1e-5)


def test_fp8_kv_pool_matches_dense_on_the_stored_values():
    """FP8 KV under fp32 queries: batched attention reads the pool's values (reference on the rounded K/V)."""
    fp8 = torch.float8_e4m3fn
    case = build_case(ForwardMode.DECODE, [5, 20, 0], [1, 1, 1], page_size=16, num_kv_heads=2, group=2, head_dim=16, kv_dtype=fp8)
    out = run_backend(TorchNativeAttnBackend(), case)
    case.dense_k = [k.to(fp8).float() for k in case.dense_k]
    case.dense_v = [v.to(fp8).float() for v in case.dense_v]
    torch.testing.assert_close(out, dense_reference(case, causal=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 40, 5])
@pytest.mark.parametrize("group", [1, 3])
def test_fresh_equal_prompts_take_sdpa_causal_and_equal_dense(sliding_window, group):
    """Equal prompts with no prefix use SDPA's is_causal (a window shorter than the prompt needs the mask)."""
    case = build_case(
        ForwardMode.EXTEND, [0, 0, 0], [9, 9, 9], page_size=16, num_kv_heads=2, group=group, head_dim=16,
        sliding_window=sliding_window, seed=7,
    )
    backend = TorchNativeAttnBackend()
    out = run_backend(backend, case)
    assert [g.plain_causal_ok for g in backend._groups] == [True]
    torch.testing.assert_close(out, dense_reference(case, causal=True), atol=1e-5, rtol=1e-5)


def _sub_batch(case, mode, members):
    """The ``members`` requests of ``case`` as their own batch over the same pools and slots (new K/V included)."""
    fb = case.forward_batch
    starts = [sum(case.extend_lens[:i]) for i in range(len(case.extend_lens))]
    tokens = torch.cat([torch.arange(starts[i], starts[i] + case.extend_lens[i]) for i in members])
    rows = fb.req_pool_indices.tolist()
    sub = build_forward_batch(
        mode,
        [(rows[i], case.prefix_lens[i], [0] * case.extend_lens[i]) for i in members],
        req_to_token_pool=fb.req_to_token_pool,
        token_to_kv_pool=fb.token_to_kv_pool,
        out_cache_loc=fb.out_cache_loc[tokens],
    )
    return sub, tokens


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_rows_equal_separate_decode_and_extend_batches(page_size):
    """--enable-mixed-chunk: prompts plus decoding requests in one EXTEND. The decoding rows take the decode
    path (never padded to a prompt's query count, even a short one the padding limit would let join) and
    every row is bit-identical to a separate DECODE / EXTEND batch of the same requests."""
    prefix = [0, 0, 30, 45, 12, 7, 60, 20, 23]
    extend = [24, 16, 1, 1, 1, 1, 1, 1, 1]
    case = build_case(ForwardMode.EXTEND, prefix, extend, page_size=page_size, num_kv_heads=2, group=3, head_dim=16)
    backend = TorchNativeAttnBackend()
    mixed = run_backend(backend, case)
    decoding = list(range(2, 9))
    assert [g.members for g in backend._groups if g.max_q == 1] == [decoding]
    assert all(g.max_q > 1 for g in backend._groups if g.members != decoding)
    torch.testing.assert_close(mixed, dense_reference(case, causal=True), atol=1e-5, rtol=1e-5)
    for mode, members in ((ForwardMode.DECODE, decoding), (ForwardMode.EXTEND, [0, 1])):
        sub, tokens = _sub_batch(case, mode, members)
        sub.attn_backend = alone = TorchNativeAttnBackend()
        alone.init_forward_metadata(sub)
        out = case.layer(case.q[tokens], case.k[tokens], case.v[tokens], sub)
        assert torch.equal(mixed[tokens], out), mode.name
