"""On CUDA: every served family with compiled Triton (and torch_native, flashinfer for MLA) equals transformers."""

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs
from sglite.testing.runner_generate import greedy_generate, hf_greedy
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "gpu"
EST_TIME = 60

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 17, 300, 41, 7, 99, 250], [100, 200, 300], list(range(60, 84)), [42]]
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]
SHARED_PROMPTS = [SHARED + [200, 201, 202], SHARED + [7], SHARED + list(range(300, 310))]


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_models_match_transformers(arch, backend, tmp_path):
    d = build_tiny_model(str(tmp_path / arch), arch, seed=31, with_tokenizer=False, eos_token_id=None, num_hidden_layers=3)
    hf = load_hf_model(d).cuda()
    with torch.no_grad():
        ref_logits = torch.stack([hf(torch.tensor([p], device="cuda")).logits[0, -1] for p in PROMPTS])
    expected, expected_shared = hf_greedy(hf, PROMPTS, 32), hf_greedy(hf, SHARED_PROMPTS, 32)
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            # A small cap keeps the pool tiny: on CUDA the budget is a share of the whole device.
            args = ServerArgs(
                model_path=d, device="cuda", attention_backend=backend, page_size=16,
                max_total_tokens=8192, max_running_requests=16,
            ).validate()
            runner = ModelRunner(args)
            assert runner.device.type == "cuda"
            rows = runner.req_to_token_pool.alloc(len(PROMPTS))
            out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, PROMPTS)]))
            torch.testing.assert_close(out.next_token_logits, ref_logits.float(), atol=2e-4, rtol=0)
            runner.req_to_token_pool.free(rows)
            assert greedy_generate(runner, PROMPTS, 32) == expected
            assert greedy_generate(runner, SHARED_PROMPTS, 32, shared_prefix_len=len(SHARED)) == expected_shared
        finally:
            destroy_parallel_runtime()


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "torch_native"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_cuda_moe_families_match_transformers(arch, backend, tmp_path):
    """MoE through the Triton fused experts; DeepSeek-V3 with DeepSeek's real MLA widths (kv_lora 512, rope 64),
    the ones flashinfer's MLA kernels are built for."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
        if arch != "deepseek_v3":
            pytest.skip("the flashinfer MLA path is what this case checks")
    extra = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128) if arch == "deepseek_v3" else {}
    d = build_tiny_model(str(tmp_path / arch), arch, seed=31, with_tokenizer=False, eos_token_id=None,
                         num_hidden_layers=2, **extra)
    hf = load_hf_model(d).cuda()
    expected = hf_greedy(hf, PROMPTS, 16)
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            args = ServerArgs(model_path=d, device="cuda", attention_backend=backend, page_size=1,
                              max_total_tokens=4096, max_running_requests=8).validate()
            runner = ModelRunner(args)
            assert greedy_generate(runner, PROMPTS, 16) == expected
        finally:
            destroy_parallel_runtime()
