"""flashinfer backend plumbing on CPU: its page table and plan arguments, read by a stand-in that
follows flashinfer's documented wrapper semantics, give torch_native's results.

This checks *our* side (CSR page table from req_to_token, one-token NHD pages, causal flag per mode,
window_left = sliding_window - 1, decode vs prefill wrapper); the real kernels run in the GPU suite.
"""

SUITE = "unit-cpu"
EST_TIME = 5

import types
from types import SimpleNamespace

import pytest
import torch

from attention_cases import build_case, run_backend
from sglite.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend, window_left
from sglite.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglite.srt.model_executor.forward_batch_info import ForwardMode


class _PagedWrapper:
    """Documented semantics: request b's keys are pages kv_indices[kv_indptr[b]:kv_indptr[b+1]] of an NHD
    cache ``[pages, page_size, Hkv, D]``, the last one filled to kv_last_page_len[b]; causal masks align the
    queries to the end of the keys; window_left w keeps keys ``[q - w, q]``."""

    def __init__(self, workspace, kv_layout, decode):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.decode = decode

    def plan(self, *args, **kw):
        if self.decode:
            kv_indptr, kv_indices, last, hq, hkv, d, page = args
            qo_indptr = torch.arange(kv_indptr.numel(), dtype=torch.int32)
            causal = True
        else:
            qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, page = args
            causal = kw["causal"]
        self.p = dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), idx=kv_indices.tolist(), last=last.tolist(),
                      page=page, causal=causal, window=kw["window_left"], scale=kw["sm_scale"], hq=hq, hkv=hkv)

    def run(self, q, kv_cache):
        k_cache, v_cache = kv_cache
        p = self.p
        assert q.shape[1] == p["hq"] and k_cache.shape[1:3] == (p["page"], p["hkv"])
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        for b in range(len(p["qo"]) - 1):
            pages = p["idx"][p["kv"][b] : p["kv"][b + 1]]
            keys = torch.cat([k_cache[pg] for pg in pages])[: (len(pages) - 1) * p["page"] + p["last"][b]]
            vals = torch.cat([v_cache[pg] for pg in pages])[: keys.shape[0]]
            qb = q[p["qo"][b] : p["qo"][b + 1]]
            n, s = qb.shape[0], keys.shape[0]
            qpos = torch.arange(s - n, s)[:, None]
            kpos = torch.arange(s)[None, :]
            allowed = (kpos <= qpos) if p["causal"] else torch.ones(n, s, dtype=torch.bool)
            if p["window"] >= 0:
                allowed &= kpos >= qpos - p["window"]
            o = torch.nn.functional.scaled_dot_product_attention(
                qb.transpose(0, 1).float(), keys.transpose(0, 1).float(), vals.transpose(0, 1).float(),
                attn_mask=allowed, scale=p["scale"], enable_gqa=True,
            )
            out[p["qo"][b] : p["qo"][b + 1]] = o.transpose(0, 1).to(out.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = lambda ws, layout: _PagedWrapper(ws, layout, decode=False)
    mod.BatchDecodeWithPagedKVCacheWrapper = lambda ws, layout: _PagedWrapper(ws, layout, decode=True)
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", mod)
    monkeypatch.setattr("sglite.srt.layers.attention.flashinfer_backend.WORKSPACE_BYTES", 1024)
    return mod


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK], ids=lambda m: m.name)
@pytest.mark.parametrize("sliding_window,v_head_dim", [(None, None), (5, None), (None, 8)])
def test_flashinfer_plumbing_matches_torch_native(fake_flashinfer, mode, sliding_window, v_head_dim):
    prefix, extend = ([0, 9, 20], [1, 1, 1]) if mode == ForwardMode.DECODE else ([0, 9, 20], [6, 6, 6])
    kw = dict(page_size=16, num_kv_heads=2, group=2, head_dim=16, v_head_dim=v_head_dim, sliding_window=sliding_window, seed=4)
    ref = run_backend(TorchNativeAttnBackend(), build_case(mode, prefix, extend, **kw))
    backend = FlashInferAttnBackend(SimpleNamespace(device=torch.device("cpu")))
    out = run_backend(backend, build_case(mode, prefix, extend, **kw))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_window_left_convention():
    assert window_left(None) == -1
    assert window_left(1) == 0  # a query sees only itself
    assert window_left(4096) == 4095


class _MLAWrapper:
    """Documented semantics of ``flashinfer.mla.BatchMLAPagedAttentionWrapper``: request b's keys are pages
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] (page_size 1 here) of the latent cache, key = [ckv | kpe],
    value = ckv, causal masks aligned to the end of the keys, output of width head_dim_ckv."""

    def __init__(self, workspace):
        assert workspace.dtype == torch.uint8

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        assert page_size == 1 and kv_len_arr.tolist() == (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        self.p = dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), idx=kv_indices.tolist(), causal=causal,
                      scale=sm_scale, h=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        p = self.p
        assert q_nope.shape[1:] == (p["h"], p["ckv"]) and q_pe.shape[1:] == (p["h"], p["kpe"])
        out = q_nope.new_empty(q_nope.shape)
        for b in range(len(p["qo"]) - 1):
            idx = torch.tensor(p["idx"][p["kv"][b] : p["kv"][b + 1]])
            keys = torch.cat([ckv_cache[idx, 0], kpe_cache[idx, 0]], dim=-1).float()  # [S, ckv + kpe]
            q = torch.cat([q_nope, q_pe], dim=-1)[p["qo"][b] : p["qo"][b + 1]].float()  # [n, H, ckv + kpe]
            n, s = q.shape[0], keys.shape[0]
            allowed = (torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]) if p["causal"] else None
            scores = torch.einsum("nhd,sd->hns", q, keys) * p["scale"]
            if allowed is not None:
                scores = scores.masked_fill(~allowed[None], float("-inf"))
            out[p["qo"][b] : p["qo"][b + 1]] = torch.einsum("hns,sd->nhd", scores.softmax(-1), keys[:, : p["ckv"]])
        return out


def test_flashinfer_mla_plumbing_gives_transformers_tokens(fake_flashinfer, tmp_path, rank0):
    """DeepSeek-V3's MLA layers through the flashinfer backend's MLA path (every mode a greedy run takes)."""
    from sglite.srt.model_executor.model_runner import ModelRunner
    from sglite.srt.server_args import ServerArgs
    from sglite.testing.runner_generate import greedy_generate, hf_greedy
    from sglite.testing.tiny_models import build_tiny_model, load_hf_model

    fake_flashinfer.mla = SimpleNamespace(BatchMLAPagedAttentionWrapper=_MLAWrapper)
    d = build_tiny_model(str(tmp_path / "ds"), "deepseek_v3", seed=5, with_tokenizer=False, eos_token_id=None)
    runner = ModelRunner(ServerArgs(model_path=d, device="cpu", cpu_kv_cache_budget_mb=2).validate())
    runner.attn_backend = FlashInferAttnBackend(SimpleNamespace(device=torch.device("cpu")))
    prompts = [[5, 17, 300, 41, 7], [100, 200, 300], list(range(60, 80))]
    assert greedy_generate(runner, prompts, 8) == hf_greedy(load_hf_model(d), prompts, 8)
