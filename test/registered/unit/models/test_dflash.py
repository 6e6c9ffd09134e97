"""DFLASH draft model: the block forward equals `dflash.model.DFlashDraftModel` on the same tiny weights."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.bootstrap import destroy_parallel_runtime, init_parallel_runtime
from sglite.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglite.srt.layers.logits_processor import LogitsProcessor
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglite.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglite.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglite.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglite.srt.model_loader.weight_utils import WeightLoadingError
from sglite.srt.models.dflash import DFlashDraftModel
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.testing.tiny_dflash import TinyDraftSpec, build_tiny_dflash_draft, build_tiny_target, load_reference_pair

SUITE = "unit-cpu"
EST_TIME = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    target_dir = build_tiny_target(str(d / "target"), seed=0)
    draft_dir = build_tiny_dflash_draft(str(d / "draft"), target_dir, seed=1, spec=TinyDraftSpec(block_size=4))
    return target_dir, draft_dir


@pytest.fixture()
def one_rank():
    torch.set_num_threads(1)
    state = ParallelState(tp_size=1)
    with scoped(parallel=state):
        init_parallel_runtime(state, 0, 1, None, "gloo")
        try:
            yield state
        finally:
            destroy_parallel_runtime()


def load_sglite_draft(draft_dir: str, target) -> DFlashDraftModel:
    cfg = ModelConfig.from_path(draft_dir)
    model = DFlashDraftModel(cfg, params_dtype=torch.float32)
    model.load_weights(load_file(os.path.join(draft_dir, "model.safetensors")).items())
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    embed = VocabParallelEmbedding(vocab, hidden, params_dtype=torch.float32)
    embed.weight_loader(embed.weight, target.get_input_embeddings().weight.detach())
    head = ParallelLMHead(vocab, hidden, params_dtype=torch.float32)
    head.weight_loader(head.weight, target.lm_head.weight.detach())
    model.attach_target_head(embed, head, LogitsProcessor(vocab))
    return model


def test_config_is_public_format(pair):
    _, draft_dir = pair
    raw = json.load(open(os.path.join(draft_dir, "config.json")))
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"block_size": 4, "mask_token_id": 511, "target_layer_ids": [1, 2]}
    names = set(load_file(os.path.join(draft_dir, "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any(n.startswith("embed_tokens") or n.startswith("lm_head") for n in names)


@torch.no_grad()
def test_block_forward_matches_reference(pair, one_rank):
    target_dir, draft_dir = pair
    target, ref = load_reference_pair(target_dir, draft_dir)
    ours = load_sglite_draft(draft_dir, target)
    block = ours.block_size
    ctx_lens = [7, 3]
    g = torch.Generator().manual_seed(3)
    feats = [torch.randn(n, 2 * 64, generator=g) for n in ctx_lens]
    anchors = [17, 250]

    cfg = ours.config
    size = 64
    allocator = PagedTokenToKVPoolAllocator(size, 1, "cpu")
    req_pool = ReqToTokenPool(4, 32, "cpu")
    pool = MHATokenToKVPool(size, 1, torch.float32, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim, cfg.num_hidden_layers, "cpu")
    rows = req_pool.alloc(len(ctx_lens))
    # Context KV at the "target's" slots.
    for row, n, f in zip(rows, ctx_lens, feats):
        slots = allocator.alloc(n)
        req_pool.req_to_token[row, :n] = slots.to(req_pool.req_to_token.dtype)
        ours.write_context_kv(f, torch.arange(n), slots, pool)
    backend = TorchNativeAttnBackend()
    reqs = [(row, n, [a] + [ours.mask_token_id] * (block - 1)) for row, n, a in zip(rows, ctx_lens, anchors)]
    fb = build_forward_batch(
        ForwardMode.DRAFT_BLOCK, reqs, req_to_token_pool=req_pool, token_to_kv_pool=pool, allocator=allocator, attn_backend=backend
    )
    backend.init_forward_metadata(fb)
    out = ours(fb.input_ids, fb.positions, fb)
    assert out.next_token_logits.shape == (len(ctx_lens) * block, 512)

    embed = target.get_input_embeddings().weight
    for i, (n, f, a) in enumerate(zip(ctx_lens, feats, anchors)):
        ids = torch.tensor([[a] + [ref.mask_token_id] * (block - 1)])
        ref_h = ref(
            position_ids=torch.arange(n + block)[None],
            noise_embedding=torch.nn.functional.embedding(ids, embed),
            target_hidden=f[None],
        )[0]
        got = out.hidden_states[i * block : (i + 1) * block]
        torch.testing.assert_close(got, ref_h, atol=1e-4, rtol=0)
        ref_logits = ref.compute_logits(ref_h, target.lm_head)
        torch.testing.assert_close(out.next_token_logits[i * block : (i + 1) * block], ref_logits, atol=1e-4, rtol=0)


def test_unknown_weight_is_an_error(pair, one_rank):
    _, draft_dir = pair
    model = DFlashDraftModel(ModelConfig.from_path(draft_dir), params_dtype=torch.float32)
    weights = dict(load_file(os.path.join(draft_dir, "model.safetensors")))
    weights["embed_tokens.weight"] = torch.zeros(512, 64)
    with pytest.raises(WeightLoadingError, match="embed_tokens"):
        model.load_weights(weights.items())
    weights.pop("embed_tokens.weight")
    weights.pop("fc.weight")
    with pytest.raises(WeightLoadingError, match="missing"):
        model.load_weights(weights.items())


def test_default_target_layer_rule(tmp_path):
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 5,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "num_target_layers": 36, "dflash_config": {"mask_token_id": 511},
    }
    cfg = ModelConfig.from_dict(raw)
    from dflash.model import build_target_layer_ids

    assert cfg.draft.target_layer_ids == build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert cfg.draft.block_size == 16
