"""Compile the attention kernels ahead of time for a CUDA arch, on any host (no GPU or driver needed).

The interpreter runs the kernels' math but not the compiler; this catches what only compiled mode
rejects (types, layouts, unsupported ops, shared-memory use) for the GPU image's Triton. Run it in a
process without ``TRITON_INTERPRET=1``:  ``python -m sglite.srt.layers.attention.triton_ops.aot_check``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class CompiledKernelInfo:
    """One compiled variant: kernel name, the dtypes it was built for, and its shared memory bytes."""

    kernel: str
    variant: str
    shared_bytes: int


def _jit_fn(kernel: Any) -> Any:
    # An autotuned kernel wraps the JITFunction in ``.fn``; a plain JITFunction has ``params`` itself.
    return kernel if hasattr(kernel, "params") else kernel.fn


def _signature(fn: Any, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name, param in zip(fn.arg_names, fn.params):
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    missing = set(constexprs) - {n for n, t in sig.items() if t == "constexpr"}
    if missing:
        raise ValueError(f"{fn.__name__}: {sorted(missing)} are not constexpr parameters")
    return sig


def compile_attention_kernels(arch: int = 90, dtype: str = "bf16", kv_dtype: str | None = None, head_dim: int = 128, group: int = 4) -> list[CompiledKernelInfo]:
    """Compile extend (causal; non-causal + window), split-K (decode; 16-token block) and merge kernels for ``cuda:arch``."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("aot_check compiles kernels: run it in a process without TRITON_INTERPRET=1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglite.srt.layers.attention.triton_ops import decode_attention, extend_attention

    kv_dtype = kv_dtype or dtype
    target = GPUTarget("cuda", arch, 32)
    out: list[CompiledKernelInfo] = []

    def build(kernel: Any, pointers: dict[str, str], constexprs: dict[str, Any], variant: str) -> None:
        fn = _jit_fn(kernel)
        sig = _signature(fn, pointers, ("sm_scale_log2",), constexprs)
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=target, options={"num_warps": 4, "num_stages": 2})
        out.append(CompiledKernelInfo(fn.__name__, variant, int(compiled.metadata.shared)))

    dot_fp32 = dtype == "fp32"
    block_d = max(16, triton.next_power_of_2(head_dim))
    kv_ptrs = {"K_Buf": "*" + kv_dtype, "V_Buf": "*" + kv_dtype, "Req_to_token": "*i32", "Req_pool_indices": "*i64"}
    for causal in (True, False):
        build(
            extend_attention._extend_kernel,
            {"Q": "*" + dtype, "O": "*" + dtype, "Prefix_lens": "*i64", "Extend_lens": "*i64", "Q_start": "*i64", **kv_ptrs},
            dict(HEAD_DIM=head_dim, V_HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DV=block_d, CAUSAL=causal,
                 USE_WINDOW=not causal, DOT_FP32=dot_fp32, BLOCK_M=64, BLOCK_N=64),
            f"q={dtype} kv={kv_dtype} causal={causal}",
        )
    for block_q, causal in ((1, True), (16, False)):  # decode; a non-causal 16-token draft block
        block_g = decode_attention.split_tile(group, block_q)[0]
        build(
            decode_attention._decode_kernel,
            {"Q": "*" + dtype, "Seq_lens": "*i64", "Extend_lens": "*i64", "Q_start": "*i64", "Mid_O": "*fp32", "Mid_LSE": "*fp32", **kv_ptrs},
            dict(HEAD_DIM=head_dim, V_HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DV=block_d, BLOCK_Q=block_q, BLOCK_G=block_g,
                 NUM_SPLITS=8, IS_DECODE=block_q == 1, CAUSAL=causal, USE_WINDOW=True, DOT_FP32=dot_fp32, BLOCK_N=64),
            f"q={dtype} kv={kv_dtype} block={block_q} causal={causal}",
        )
    build(
        decode_attention._decode_merge_kernel,
        {"Mid_O": "*fp32", "Mid_LSE": "*fp32", "O": "*" + dtype},
        dict(V_HEAD_DIM=head_dim, BLOCK_DV=block_d, NUM_SPLITS=8, BLOCK_S=8),
        f"o={dtype}",
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Compile for the given arch/dtypes and print shared-memory use per variant."""
    parser = argparse.ArgumentParser(description="AOT-compile sglite's Triton attention kernels")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--kv-dtype", default=None, help="e.g. fp8e4nv for an FP8 KV cache (default: --dtype)")
    args = parser.parse_args(argv)
    for info in compile_attention_kernels(args.arch, args.dtype, args.kv_dtype):
        print(f"{info.kernel:24s} {info.variant:36s} shared={info.shared_bytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
