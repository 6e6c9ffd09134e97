"""Tiny models with the Triton attention backend (interpreter on CPU) equal transformers end to end.

DeepSeek-V3's MLA runs through the same kernels as one KV head whose key is the whole latent
(``kv_lora_rank + qk_rope_head_dim`` wide) and whose value is its compressed part."""

import os

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.runner_generate import greedy_generate, hf_greedy
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 35

SHARED = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by test/conftest.py on CPU hosts)",
)
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_triton_backend_matches_transformers(tmp_path, arch):
    torch.set_num_threads(1)
    d = build_tiny_model(str(tmp_path / arch), arch, seed=21, with_tokenizer=False, eos_token_id=None)
    hf = load_hf_model(d)
    prompts = [SHARED + [200, 201, 202], SHARED + [7], SHARED + list(range(300, 306))]
    n = 6  # the interpreter is slow: a few decode steps cover the decode kernel
    expected = hf_greedy(hf, prompts, n)
    assert_clear_greedy_margins(hf, prompts, expected)  # exact equality below needs no near-ties
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            args = ServerArgs(
                model_path=d, device="cpu", cpu_kv_cache_budget_mb=1, page_size=4, attention_backend="triton"
            ).validate()
            runner = ModelRunner(args)
            rows = runner.req_to_token_pool.alloc(1)
            out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(rows[0], 0, prompts[0])]))
            with torch.no_grad():
                ref = hf(torch.tensor([prompts[0]])).logits[0, -1]
            torch.testing.assert_close(out.next_token_logits[0], ref, atol=1e-4, rtol=0)
            assert greedy_generate(runner, prompts, n, shared_prefix_len=len(SHARED)) == expected
        finally:
            destroy_parallel_runtime()
