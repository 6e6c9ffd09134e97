"""ModelRunner wiring: pools from the memory plan, draft runner sharing, batch building, sampling, errors."""

import pytest
import torch

from sglite.srt.layers import cpu_gemm
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.server_args import ServerArgs
from sglite.testing.tiny_dflash import TinyDraftSpec, build_tiny_dflash_draft, build_tiny_target
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("m")), "qwen3", seed=5, with_tokenizer=False, eos_token_id=None)


@pytest.fixture(scope="module")
def dflash_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    target = build_tiny_target(str(d / "target"), seed=0)
    draft = build_tiny_dflash_draft(str(d / "draft"), target, seed=1, spec=TinyDraftSpec(block_size=4))
    return target, draft


def test_pools_follow_the_memory_plan(model_dir, rank0):
    args = ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=1, page_size=4).validate()
    runner = ModelRunner(args)
    plan = runner.memory_pool_config
    assert plan.max_total_num_tokens > 0 and plan.max_total_num_tokens % 4 == 0
    # 2 layers x 2 KV heads x (16 + 16) x 4 bytes per token.
    assert plan.target_cell_bytes == 2 * 2 * 32 * 4
    assert runner.token_to_kv_pool.size == plan.max_total_num_tokens
    assert runner.token_to_kv_pool_allocator.available_size() == plan.max_total_num_tokens
    assert runner.token_to_kv_pool.head_num == 2 and runner.token_to_kv_pool.layer_num == 2
    assert plan.planned_total_bytes() <= 1 << 20
    assert runner.spec_aux_config.has_draft is False
    assert runner.dtype == torch.float32 and runner.device == torch.device("cpu")
    # The runner's KV dtype is the torch dtype its pool stores (the plan keeps the name, for JSON).
    assert runner.kv_cache_dtype == torch.float32 == runner.token_to_kv_pool.dtype


def test_sample_and_forward_batch_helper(model_dir, rank0):
    runner = ModelRunner(ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=1).validate())
    hf = load_hf_model(model_dir)
    rows = runner.req_to_token_pool.alloc(2)
    prompts = [[1, 2, 3, 4], [9, 8]]
    batch = runner.build_forward_batch(ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, prompts)])
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1]
    assert batch.seq_lens_cpu == [4, 2] and batch.extend_prefix_lens_cpu == [0, 0]
    table = runner.req_to_token_pool.req_to_token
    assert table[rows[0], :4].tolist() == batch.out_cache_loc[:4].tolist()
    logits = runner.forward(batch).next_token_logits
    greedy = runner.sample(logits, SamplingBatchInfo.from_sampling_params([SamplingParams(temperature=0.0)] * 2, 512))
    with torch.no_grad():
        want = [int(hf(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    assert greedy.tolist() == want
    sampled = runner.sample(logits, SamplingBatchInfo.from_sampling_params([SamplingParams(top_k=3)] * 2, 512))
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(s) in top3[i].tolist() for i, s in enumerate(sampled))


def test_exhausted_pool_and_bad_batches_are_clear_errors(model_dir, rank0):
    args = ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=1, max_total_tokens=32).validate()
    runner = ModelRunner(args)
    assert runner.memory_pool_config.max_total_num_tokens == 32
    row = runner.req_to_token_pool.alloc(1)[0]
    with pytest.raises(RuntimeError, match="KV pool exhausted"):
        runner.build_forward_batch(ForwardMode.EXTEND, [(row, 0, list(range(40)))])
    with pytest.raises(ValueError, match="DECODE takes exactly one"):
        runner.build_forward_batch(ForwardMode.DECODE, [(row, 0, [1, 2])])
    with pytest.raises(ValueError, match="a draft ModelRunner needs target_runner"):
        ModelRunner(args, is_draft=True)


def test_draft_runner_shares_allocator_and_table(dflash_pair, rank0):
    target_dir, draft_dir = dflash_pair
    args = ServerArgs(
        model_path=target_dir, device="cpu", cpu_kv_cache_budget_mb=1,
        speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir,
    ).validate()
    target = ModelRunner(args)
    assert list(target.spec_aux_config.target_layer_ids) == [1, 2]
    assert target.memory_pool_config.draft_cell_bytes == 2 * 2 * 32 * 4  # 2 draft layers, 2 KV heads, fp32
    draft = ModelRunner(args, is_draft=True, target_runner=target)
    assert draft.memory_pool_config is target.memory_pool_config
    assert draft.token_to_kv_pool_allocator is target.token_to_kv_pool_allocator
    assert draft.req_to_token_pool is target.req_to_token_pool
    assert draft.token_to_kv_pool is not target.token_to_kv_pool
    assert draft.token_to_kv_pool.layer_num == 2 and target.token_to_kv_pool.layer_num == 4
    assert draft.token_to_kv_pool.size == target.token_to_kv_pool.size
    assert draft.kv_cache_dtype == torch.float32 == draft.token_to_kv_pool.dtype
    assert draft.model.get_embed_tokens() is target.model.get_embed_tokens()
    assert draft.model.get_lm_head() is target.model.get_lm_head()

    # Target prefill with aux capture at the draft's layers; a draft block then runs on the shared slots.
    row = target.req_to_token_pool.alloc(1)[0]
    prompt = [5, 6, 7, 8, 9]
    out = target.forward(
        target.build_forward_batch(ForwardMode.EXTEND, [(row, 0, prompt)], capture_aux_hidden_layers=[1, 2])
    )
    assert out.aux_hidden_states.shape == (5, 2 * 64)
    block = draft.build_forward_batch(ForwardMode.DRAFT_BLOCK, [(row, 0, [5, 511, 511, 511])])
    assert draft.forward(block).next_token_logits.shape == (4, 512)
    with pytest.raises(ValueError, match="another runner's pool"):
        target.forward(block)


def test_draft_packs_its_cpu_weights_like_its_target(dflash_pair, rank0, monkeypatch):
    """The pack layout is timed once, on the target; the draft takes it, whatever its own default would be."""
    if "mkl" not in cpu_gemm.available_pack_layouts():
        pytest.skip("torch built without MKL")
    target_dir, draft_dir = dflash_pair
    args = ServerArgs(
        model_path=target_dir, device="cpu", cpu_kv_cache_budget_mb=1,
        speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir,
    ).validate()
    monkeypatch.setattr(cpu_gemm, "DEFAULT_PACK_LAYOUT", "mkl")  # as if the target's probe had chosen MKL
    target = ModelRunner(args)
    monkeypatch.setattr(cpu_gemm, "DEFAULT_PACK_LAYOUT", "onednn")
    draft = ModelRunner(args, is_draft=True, target_runner=target)
    assert target.cpu_pack.layout == draft.cpu_pack.layout == "mkl"
    packed = [m for m in draft.model.modules() if m.__dict__.get("packed_weight") is not None]
    assert packed and all(m.packed_weight.tensor.shape != m.weight.shape for m in packed)  # MKL's flat buffers


def test_bfloat16_runner(model_dir, rank0):
    """--dtype bfloat16: bf16 weights and KV pool; logits close to transformers in bf16."""
    runner = ModelRunner(ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=1, dtype="bfloat16").validate())
    assert runner.dtype == torch.bfloat16
    assert runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert runner.token_to_kv_pool.get_key_buffer(0).dtype == torch.bfloat16
    hf = load_hf_model(model_dir).to(torch.bfloat16)
    prompt = [3, 30, 300, 33, 7]
    row = runner.req_to_token_pool.alloc(1)[0]
    logits = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, [(row, 0, prompt)])).next_token_logits[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() <= 0.03 * ref.abs().max()


def test_draft_runs_in_the_target_dtype_whatever_it_stores(dflash_pair, tmp_path, rank0):
    """A bf16-stored draft of an fp32 target runs in fp32 under --dtype auto (it shares the target's head and
    hidden states, and the plan prices its KV in the target's dtype): the same logits as an fp32 copy of the
    bf16-rounded weights."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    target_dir, draft_dir = dflash_pair
    weights = load_file(f"{draft_dir}/model.safetensors")
    copies = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        d = tmp_path / name
        shutil.copytree(draft_dir, d)
        save_file({k: v.to(torch.bfloat16).to(dtype).contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
        config = json.loads((d / "config.json").read_text())
        config["dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float32"
        config.pop("torch_dtype", None)
        (d / "config.json").write_text(json.dumps(config))
        copies[name] = str(d)
    args = ServerArgs(
        model_path=target_dir, device="cpu", cpu_kv_cache_budget_mb=1,
        speculative_algorithm="DFLASH", speculative_draft_model_path=copies["bf16"],
    ).validate()
    target = ModelRunner(args)
    row = target.req_to_token_pool.alloc(1)[0]
    target.forward(target.build_forward_batch(ForwardMode.EXTEND, [(row, 0, [5, 6, 7, 8, 9])], capture_aux_hidden_layers=[1, 2]))
    logits = {}
    for name, path in copies.items():
        draft = ModelRunner(args, is_draft=True, target_runner=target, model_path=path)
        assert draft.dtype == target.dtype == torch.float32
        assert draft.model.fc.weight.dtype == torch.float32
        block = draft.build_forward_batch(ForwardMode.DRAFT_BLOCK, [(row, 0, [5, 511, 511, 511])])
        logits[name] = draft.forward(block).next_token_logits
    assert torch.equal(logits["bf16"], logits["fp32"])


@pytest.mark.parametrize("dtype, builds", [("float32", True), ("bfloat16", False)])
def test_a_cpu_target_compiles_the_small_m_kernel_only_for_fp32_weights(model_dir, rank0, monkeypatch, dtype, builds):
    """The 2-16 row kernel serves fp32 linears only, so a bf16 target does not spend a first start compiling it."""
    from sglite.srt.layers import cpu_gemm

    calls = []
    monkeypatch.setattr(cpu_gemm, "start_building_small_m_kernel", lambda: calls.append(True))
    runner = ModelRunner(ServerArgs(model_path=model_dir, device="cpu", cpu_kv_cache_budget_mb=1, dtype=dtype).validate())
    assert runner.dtype == getattr(torch, dtype)
    assert calls == ([True] if builds else [])
