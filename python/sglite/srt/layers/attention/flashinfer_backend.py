"""flashinfer attention backend (optional, CUDA only; ``pip install 'sglite[gpu]'``).

The token pool is viewed as flashinfer pages of one token (``[S, 1, Hkv, D]``, NHD), so each
request's page list is simply ``req_to_token[row, :seq_len]`` and any sglite page size works.
EXTEND / TARGET_VERIFY plan the prefill wrapper causally (flashinfer aligns the causal mask to the
end of the KV, i.e. query i at position P+i), DRAFT_BLOCK plans it non-causally, and DECODE uses the
decode wrapper (or the prefill wrapper when v_head_dim != head_dim, which the decode kernels lack). MLA layers
(``RadixAttention.mla_rope_dim``) run flashinfer's MLA paged kernel over the latent pool in every mode.
Plans are made once per batch and per distinct layer geometry, on the first layer that needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from sglite.srt.layers.attention.base_attn_backend import AttentionBackend, mode_name

if TYPE_CHECKING:
    from sglite.srt.layers.attention.radix_attention import RadixAttention
    from sglite.srt.model_executor.forward_batch_info import ForwardBatch

WORKSPACE_BYTES = 128 * 1024 * 1024


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "--attention-backend flashinfer needs the flashinfer package (pip install 'sglite[gpu]'); "
            "or use --attention-backend triton"
        ) from e
    return flashinfer


@dataclass
class FlashInferBatchIndex:
    """CSR page table of one batch with one-token pages (shared by every plan of the batch)."""

    qo_indptr: torch.Tensor  # [bs+1] int32
    kv_indptr: torch.Tensor  # [bs+1] int32
    kv_indices: torch.Tensor  # [sum(seq_lens)] int32 slot ids
    kv_last_page_len: torch.Tensor  # [bs] int32, all ones
    kv_lens: torch.Tensor  # [bs] int32 keys per request (the MLA kernel's kv_len_arr)
    plans: dict[tuple, Any] = field(default_factory=dict)  # geometry key -> planned wrapper


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    out[1:] = torch.cumsum(lens, dim=0).to(torch.int32)
    return out


def window_left(sliding_window: Optional[int]) -> int:
    """flashinfer's ``window_left`` (keys ``[q - window_left, q]``) for HF's ``q - k < sliding_window``; -1 = full."""
    return -1 if sliding_window is None else sliding_window - 1


class FlashInferAttnBackend(AttentionBackend):
    """Paged attention through flashinfer's batch prefill / decode wrappers."""

    # Eager only: plans are made on the host per batch and kv_indices has a data-dependent length;
    # graphs would need flashinfer's CUDA-graph wrappers over fixed-size index buffers (not done).
    supports_cuda_graph = False

    def __init__(self, runner: Any) -> None:
        self.flashinfer = _import_flashinfer()
        self.device = torch.device(runner.device)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.index: Optional[FlashInferBatchIndex] = None
        self.mode: Optional[str] = None

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Build the batch's page table; wrappers are planned lazily per layer geometry."""
        self.mode = mode_name(forward_batch)
        if self.mode == "IDLE":
            self.index = None
            return
        seq_lens = forward_batch.seq_lens
        max_len = max(int(s) for s in forward_batch.seq_lens_cpu)
        rows = forward_batch.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, :max_len]
        valid = torch.arange(max_len, device=seq_lens.device)[None, :] < seq_lens[:, None]
        new_tokens = torch.ones_like(seq_lens) if self.mode == "DECODE" else forward_batch.extend_seq_lens
        self.index = FlashInferBatchIndex(
            qo_indptr=_indptr(new_tokens),
            kv_indptr=_indptr(seq_lens),
            kv_indices=rows[valid].to(torch.int32),
            kv_last_page_len=torch.ones_like(seq_lens, dtype=torch.int32),
            kv_lens=seq_lens.to(torch.int32),
        )

    def _wrapper(self, layer: "RadixAttention", forward_batch: "ForwardBatch", kv_dtype: torch.dtype, q_dtype: torch.dtype, causal: bool, decode: bool) -> Any:
        if self.index is None or self.mode != mode_name(forward_batch):
            raise RuntimeError("FlashInferAttnBackend.forward called before init_forward_metadata(forward_batch)")
        use_decode_kernel = decode and layer.head_dim == layer.v_head_dim
        key = (use_decode_kernel, causal, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim, layer.sliding_window, layer.scaling)
        if key in self.index.plans:
            return self.index.plans[key]
        ix = self.index
        if use_decode_kernel:
            wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
            wrapper.plan(
                ix.kv_indptr, ix.kv_indices, ix.kv_last_page_len,
                layer.num_heads, layer.num_kv_heads, layer.head_dim, 1,
                window_left=window_left(layer.sliding_window), sm_scale=layer.scaling,
                q_data_type=q_dtype, kv_data_type=kv_dtype,
            )
        else:
            wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            wrapper.plan(
                ix.qo_indptr, ix.kv_indptr, ix.kv_indices, ix.kv_last_page_len,
                layer.num_heads, layer.num_kv_heads, layer.head_dim, 1,
                head_dim_vo=layer.v_head_dim, causal=causal, window_left=window_left(layer.sliding_window),
                sm_scale=layer.scaling, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )
        ix.plans[key] = wrapper
        return wrapper

    def _mla_wrapper(self, layer: "RadixAttention", kv_dtype: torch.dtype, q_dtype: torch.dtype, causal: bool) -> Any:
        """flashinfer's MLA paged kernel (compressed KV + rope key, absorbed weights), planned once per batch."""
        ix = self.index
        key = ("mla", causal, layer.num_heads, layer.v_head_dim, layer.mla_rope_dim, layer.scaling)
        if key not in ix.plans:
            wrapper = self.flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace)
            wrapper.plan(
                ix.qo_indptr, ix.kv_indptr, ix.kv_indices, ix.kv_lens, layer.num_heads, layer.v_head_dim,
                layer.mla_rope_dim, 1, causal, layer.scaling, q_dtype, kv_dtype,
            )
            ix.plans[key] = wrapper
        return ix.plans[key]

    def _run_mla(self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch", causal: bool) -> torch.Tensor:
        if self.index is None or self.mode != mode_name(forward_batch):
            raise RuntimeError("FlashInferAttnBackend.forward called before init_forward_metadata(forward_batch)")
        latent = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)  # [S, 1, ckv + kpe]: one-token pages
        wrapper = self._mla_wrapper(layer, latent.dtype, q.dtype, causal)
        q3 = q.reshape(-1, layer.num_heads, layer.head_dim)
        ckv = layer.v_head_dim
        o = wrapper.run(q3[..., :ckv], q3[..., ckv:], latent[..., :ckv], latent[..., ckv:])
        return o.reshape(-1, layer.num_heads * layer.v_head_dim)

    def _run(self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch", causal: bool, decode: bool) -> torch.Tensor:
        if layer.mla_rope_dim is not None:
            return self._run_mla(q, layer, forward_batch, causal)
        pool = forward_batch.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        wrapper = self._wrapper(layer, forward_batch, k_buf.dtype, q.dtype, causal, decode)
        # One-token pages: [S, Hkv, D] -> [S, page_size=1, Hkv, D] (NHD).
        o = wrapper.run(q.reshape(-1, layer.num_heads, layer.head_dim), (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))
        return o.reshape(-1, layer.num_heads * layer.v_head_dim)

    def forward_decode(self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        """Decode wrapper over each request's slots."""
        return self._run(q, layer, forward_batch, causal=True, decode=True)

    def forward_extend(
        self, q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch", causal: bool
    ) -> torch.Tensor:
        """Prefill wrapper; non-causal for DRAFT_BLOCK."""
        return self._run(q, layer, forward_batch, causal=causal, decode=False)
