"""On CUDA: real CUDA graphs (decode; DFLASH verify + draft block) give the same greedy tokens as eager forwards.

Batches of 5 and 3 requests run padded in the buckets of 8 and 4, so padding is exercised; a one-request
batch runs in the bucket of one. The DFLASH draft checkpoint is written here from a transformers Qwen3
stack (the GPU image has no `dflash` package); outputs are also checked against transformers' greedy target.
"""

import json
import os

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
from sglite.srt.managers.scheduler import Scheduler
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.runner_generate import greedy_generate, hf_greedy, scheduler_greedy_generate
from sglite.testing.tiny_dflash import TINY_MASK_TOKEN_ID, build_tiny_target
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "gpu"
EST_TIME = 60

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 17, 300, 41, 7, 99, 250], [100, 200, 300], list(range(60, 84)), [42], [7, 8, 9, 10]]
BLOCK = 4


def _cuda_args(model_dir, **kw):
    base = dict(
        model_path=model_dir, device="cuda", attention_backend="triton", dtype="float32", page_size=16,
        max_total_tokens=8192, max_running_requests=16, cuda_graph_max_bs=8, context_length=256,
    )
    base.update(kw)
    return ServerArgs(**base).validate()


def test_decode_greedy_with_graphs_equals_without(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLITE_TRITON_AUTOTUNE", "0")  # one compile per kernel variant keeps capture short
    d = build_tiny_model(str(tmp_path / "m"), "qwen3", seed=31, with_tokenizer=False, eos_token_id=None, num_hidden_layers=3)
    hf = load_hf_model(d).cuda()
    expected = hf_greedy(hf, PROMPTS, 24)
    assert_clear_greedy_margins(hf, PROMPTS, expected)
    got = {}
    for graphs in (False, True):
        with scoped(parallel=ParallelState(tp_size=1)):
            try:
                runner = ModelRunner(_cuda_args(d, disable_cuda_graph=not graphs))
                if not graphs:
                    assert runner.cuda_graph_runners == []
                else:
                    (g,) = runner.cuda_graph_runners
                    assert g.mode == ForwardMode.DECODE and g.batch_sizes == (1, 2, 4, 8)
                got[graphs] = greedy_generate(runner, PROMPTS, 24)  # bs 5: bucket 8
                got[graphs, "one"] = greedy_generate(runner, PROMPTS[:1], 24)  # bucket 1
                if graphs:
                    assert g.num_replays == 2 * 23  # every decode step ran in a graph
            finally:
                destroy_parallel_runtime()
    assert got[True] == got[False] == expected
    assert got[True, "one"] == got[False, "one"] == expected[:1]


def test_bf16_decode_graph_logits_close_to_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLITE_TRITON_AUTOTUNE", "0")
    d = build_tiny_model(str(tmp_path / "m"), "llama", seed=7, with_tokenizer=False, eos_token_id=None)
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            runner = ModelRunner(_cuda_args(d, dtype="bfloat16"))
            (g,) = runner.cuda_graph_runners
            rows = runner.req_to_token_pool.alloc(3)
            out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, PROMPTS)]))
            nxt = out.next_token_logits.argmax(-1).tolist()
            fb = runner.build_forward_batch(ForwardMode.DECODE, [(r, len(p), [t]) for r, p, t in zip(rows, PROMPTS, nxt)])
            graphed = runner.forward(fb).next_token_logits.clone()
            assert g.num_replays == 1
            runners, runner.cuda_graph_runners = runner.cuda_graph_runners, []  # the same batch, eagerly
            eager = runner.forward(fb).next_token_logits
            runner.cuda_graph_runners = runners
            torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=2e-2)
        finally:
            destroy_parallel_runtime()


def _write_dflash_draft(path, target_dir, seed=1):
    """A random DFLASH draft in the public checkpoint format, built from a transformers Qwen3 stack."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3Config, Qwen3Model

    t = AutoConfig.from_pretrained(target_dir)
    cfg = Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=2,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        max_position_embeddings=t.max_position_embeddings, initializer_range=0.3,
    )
    torch.manual_seed(seed)
    weights = {k: v for k, v in Qwen3Model(cfg).float().state_dict().items() if not k.startswith("embed_tokens")}
    weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
    layer_ids = [1, 2]
    weights["fc.weight"] = torch.randn(t.hidden_size, len(layer_ids) * t.hidden_size) * 0.05
    weights["hidden_norm.weight"] = 1.0 + 0.1 * torch.randn(t.hidden_size)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    config = cfg.to_dict()
    config.update(
        architectures=["DFlashDraftModel"], num_target_layers=t.num_hidden_layers, block_size=BLOCK,
        dflash_config={"block_size": BLOCK, "mask_token_id": TINY_MASK_TOKEN_ID, "target_layer_ids": layer_ids},
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def test_dflash_greedy_with_graphs_equals_without(tmp_path, monkeypatch):
    from sglite.srt.speculative.dflash_worker import create_dflash_worker

    monkeypatch.setenv("SGLITE_TRITON_AUTOTUNE", "0")
    target_dir = build_tiny_target(str(tmp_path / "target"), seed=0)
    draft_dir = _write_dflash_draft(str(tmp_path / "draft"), target_dir)
    prompts = PROMPTS[:3]  # bs 3: bucket 4
    hf = load_hf_model(target_dir).cuda()
    expected = hf_greedy(hf, prompts, 20)
    assert_clear_greedy_margins(hf, prompts, expected)
    got = {}
    for graphs in (False, True):
        args = _cuda_args(
            target_dir, speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir,
            disable_cuda_graph=not graphs, max_running_requests=8,
        )
        with scoped(parallel=ParallelState(tp_size=1)):
            try:
                worker = create_dflash_worker(args)
                if graphs:
                    (verify,) = worker.target_runner.cuda_graph_runners
                    (block,) = worker.draft_runner.cuda_graph_runners
                    assert (verify.mode, verify.tokens_per_req) == (ForwardMode.TARGET_VERIFY, BLOCK)
                    assert verify.capture_aux_hidden_layers == [1, 2]
                    assert (block.mode, block.tokens_per_req) == (ForwardMode.DRAFT_BLOCK, BLOCK)
                else:
                    assert worker.target_runner.cuda_graph_runners == worker.draft_runner.cuda_graph_runners == []
                got[graphs] = scheduler_greedy_generate(Scheduler(args, worker), prompts, 20)
                if graphs:
                    assert verify.num_replays > 0 and block.num_replays == verify.num_replays
            finally:
                destroy_parallel_runtime()
    assert got[True] == got[False] == expected
