"""The Triton attention kernels compile for sm_90 (H100/H200) with the installed Triton, no GPU needed.

The interpreter tests check the math; this checks what only the compiler rejects, for the dtypes the
GPU path uses (bf16 queries, bf16 and FP8 KV)."""

SUITE = "unit-cpu"
EST_TIME = 40

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8e4nv"])
def test_kernels_compile_for_sm90(tmp_path, kv_dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    proc = subprocess.run(
        [sys.executable, "-m", "sglite.srt.layers.attention.triton_ops.aot_check", "--arch", "90", "--dtype", "bf16", "--kv-dtype", kv_dtype],
        env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    kernels = [line.split()[0] for line in lines]
    assert kernels == ["_extend_attn_kernel"] * 2 + ["_split_kv_kernel"] * 2 + ["_decode_merge_kernel"]
    for line in lines:
        shared = int(line.rsplit("shared=", 1)[1])
        assert shared <= 227 * 1024, line  # fits an sm_90 SM's shared memory
