"""Decode-attention bandwidth of sglite's Triton kernel against the device's copy bandwidth.

On CUDA, for each (batch, context) case it times the split-K decode kernel over a paged KV pool and
reports the K/V bytes it must read divided by its time, next to a plain torch copy of the same number
of bytes (copy bandwidth counts read + write traffic, i.e. what the memory system sustains). The ratio
attention / copy says how close the kernel gets to the memory roofline. ``--out FILE`` writes JSON.

On a CPU-only host it runs one tiny case under TRITON_INTERPRET=1 as a smoke test: the numbers it
prints are not meaningful there.

    python benchmark/bench_attention.py [--cases 1x32768,32x8192,128x2048] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class DecodeBenchCase:
    """One decode-attention measurement setup."""

    batch_size: int
    seq_len: int
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    dtype: str
    layout: str  # "shuffled" pages or "contiguous"
    block_size: int = 1  # queries per request: 1 = decode, B = a causal verify block (split-K kernel)


@dataclass
class DecodeBenchResult:
    """Timings, bandwidths and a correctness spot check for one case."""

    case: DecodeBenchCase
    device: str
    kv_bytes: int
    num_kv_splits: int
    attn_ms: float
    attn_gbps: float
    copy_ms: float
    copy_gbps: float
    ratio: float
    max_abs_err: float
    meaningful: bool


def _time_ms(fn: Callable[[], object], on_cuda: bool, iters: int) -> float:
    if on_cuda:
        import triton.testing

        # do_bench clears L2 between runs, so repeated reads of the same K/V are not served from cache.
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) * 1000 / iters


def run_case(case: DecodeBenchCase, device: torch.device, seed: int = 0) -> DecodeBenchResult:
    """Build a paged pool for ``case``, time decode attention and a same-size copy, check a few outputs."""
    from sglite.srt.layers.attention.torch_native_backend import attention_mask, dense_attention
    from sglite.srt.layers.attention.triton_backend import choose_num_kv_splits
    from sglite.srt.layers.attention.triton_ops.decode_attention import (
        alloc_decode_buffers,
        block_split_attention_fwd,
        decode_attention_fwd,
    )

    on_cuda = device.type == "cuda"
    dtype = DTYPES[case.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    bs, seq, hkv, d, ps = case.batch_size, case.seq_len, case.num_kv_heads, case.head_dim, case.page_size
    heads = hkv * case.group
    pages_per_req = -(-seq // ps)
    num_pages = bs * pages_per_req
    slots_total = (num_pages + 1) * ps  # page 0 is the padding page
    k_buf = torch.randn(slots_total, hkv, d, generator=gen, device=device, dtype=dtype)
    v_buf = torch.randn(slots_total, hkv, d, generator=gen, device=device, dtype=dtype)
    pages = torch.arange(num_pages, device=device) + 1
    if case.layout == "shuffled":
        pages = pages[torch.randperm(num_pages, generator=gen, device=device)]
    pages = pages.view(bs, pages_per_req)
    pos = torch.arange(seq, device=device)
    req_to_token = torch.zeros(bs + 1, seq, dtype=torch.int32, device=device)
    req_to_token[1:] = (pages[:, pos // ps] * ps + pos % ps).to(torch.int32)
    req_pool_indices = torch.arange(1, bs + 1, device=device)
    seq_lens = torch.full((bs,), seq, dtype=torch.int64, device=device)
    blk = case.block_size
    q = torch.randn(bs * blk, heads, d, generator=gen, device=device, dtype=dtype)
    o = torch.empty_like(q)
    splits = choose_num_kv_splits(bs, hkv, case.group, device, 1 if blk == 1 else 1 << (blk - 1).bit_length())
    mid_o, mid_lse = alloc_decode_buffers(bs * blk, heads, d, splits, device)
    extend_lens = torch.full((bs,), blk, dtype=torch.int64, device=device)
    q_start = torch.arange(bs, device=device) * blk
    scale = d**-0.5

    def attn() -> None:
        if blk == 1:
            decode_attention_fwd(q, o, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale, splits, None, mid_o, mid_lse)
        else:
            block_split_attention_fwd(q, o, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, extend_lens, q_start,
                                      blk, scale, True, splits, None, mid_o, mid_lse)

    attn()  # compile / autotune outside the timing
    check = min(bs, 2)
    err = 0.0
    for b in range(check):
        slots = req_to_token[b + 1].long()
        rows = slice(b * blk, (b + 1) * blk)
        ref = dense_attention(q[rows], k_buf[slots], v_buf[slots], attention_mask(seq - blk, blk, True, None, device), scale)
        err = max(err, (o[rows].float() - ref).abs().max().item())

    kv_bytes = bs * seq * hkv * 2 * d * k_buf.element_size()
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    iters = 3 if on_cuda else 1
    attn_ms = _time_ms(attn, on_cuda, iters)
    copy_ms = _time_ms(lambda: dst.copy_(src), on_cuda, iters)
    attn_gbps = kv_bytes / attn_ms / 1e6
    copy_gbps = 2 * kv_bytes / copy_ms / 1e6
    return DecodeBenchResult(
        case=case, device=torch.cuda.get_device_name(device) if on_cuda else "cpu (triton interpreter)",
        kv_bytes=kv_bytes, num_kv_splits=splits, attn_ms=attn_ms, attn_gbps=attn_gbps, copy_ms=copy_ms,
        copy_gbps=copy_gbps, ratio=attn_gbps / copy_gbps, max_abs_err=err, meaningful=on_cuda,
    )


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"1x32768,32x8192"`` → ``[(1, 32768), (32, 8192)]`` (batch x context length)."""
    out = []
    for part in text.split(","):
        bs, _, seq = part.strip().partition("x")
        if not bs.isdigit() or not seq.isdigit():
            raise argparse.ArgumentTypeError(f"case {part!r} is not BATCHxCONTEXT, e.g. 32x8192")
        out.append((int(bs), int(seq)))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Parse flags, run the cases, print a table and optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=parse_cases, default=None, help="BATCHxCONTEXT list (default: CUDA 1x32768,32x8192,128x2048)")
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--layout", choices=["shuffled", "contiguous"], default="shuffled")
    parser.add_argument("--block-size", type=int, default=1, help="queries per request: 1 = decode, B = causal verify block (<= 32)")
    parser.add_argument("--out", default=None, help="write results as JSON to this file")
    args = parser.parse_args(argv)

    on_cuda = torch.cuda.is_available()
    if on_cuda:
        device = torch.device("cuda")
        cases = args.cases or [(1, 32768), (32, 8192), (128, 2048)]
        geometry = dict(num_kv_heads=args.num_kv_heads, group=args.group, head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype)
    else:
        # The interpreter reads TRITON_INTERPRET when the kernels are decorated: set it before importing them.
        if os.environ.get("TRITON_INTERPRET") != "1":
            if "sglite.srt.layers.attention.triton_ops.common" in sys.modules:
                raise RuntimeError("no CUDA: set TRITON_INTERPRET=1 before sglite's Triton kernels are imported")
            os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        cases = args.cases or [(2, 96)]
        geometry = dict(num_kv_heads=1, group=4, head_dim=64, page_size=args.page_size, dtype="fp32")
        print("no CUDA device: tiny smoke run under TRITON_INTERPRET=1 -- the numbers are NOT meaningful")

    results = []
    for bs, seq in cases:
        case = DecodeBenchCase(batch_size=bs, seq_len=seq, layout=args.layout, block_size=args.block_size, **geometry)
        r = run_case(case, device)
        results.append(r)
        print(
            f"bs={bs:4d} ctx={seq:6d} block={args.block_size:2d} kv={r.kv_bytes / 2**20:9.1f} MiB splits={r.num_kv_splits:2d} "
            f"attn {r.attn_ms:8.3f} ms {r.attn_gbps:8.1f} GB/s | copy {r.copy_gbps:8.1f} GB/s | "
            f"ratio {r.ratio:5.2f} | max err {r.max_abs_err:.2e}"
        )
    if args.out:
        import triton

        payload = {
            "benchmark": "decode_attention_bandwidth",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "meaningful": on_cuda,
            "results": [asdict(r) for r in results],
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
