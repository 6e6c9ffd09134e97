"""A PD prefill node's memory plan: no verify-block columns in the req->token rows (it never verifies),
the same KV geometry as a normal node (so its KV buffers match a decode node's), plan == real tensors.

Configs come from transformers' Qwen3Config and a DFLASH draft config.json in the public format.
"""

import json

import transformers

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.disaggregation.utils import transferable_kv_buffers
from sglite.srt.distributed.bootstrap import simulate_rank
from sglite.srt.model_executor.kv_cache_configurator import KVCacheConfigurator, build_pools
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import resolve_spec_aux_hidden_state
from sglite.srt.runtime_context import ParallelState, scoped
from sglite.srt.server_args import ServerArgs

SUITE = "unit-cpu"
EST_TIME = 5

BLOCK = 4
CONTEXT = 256


def _models(tmp_path):
    target = tmp_path / "target"
    transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=CONTEXT, torch_dtype="float32").save_pretrained(target)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 256, "torch_dtype": "float32", "block_size": BLOCK, "max_position_embeddings": CONTEXT,
        "dflash_config": {"mask_token_id": 255, "num_target_layers": 4},
    }))
    return str(target), str(draft)


class _Worker:
    """What transferable_kv_buffers reads from a DFlashWorker: the target and draft runners' pools."""

    def __init__(self, target, draft):
        self.target_runner = type("R", (), {"token_to_kv_pool": target.token_to_kv_pool})()
        self.draft_runner = type("R", (), {"token_to_kv_pool": draft.token_to_kv_pool})()


def _plan(target, draft, mode):
    sa = ServerArgs(model_path=target, device="cpu", cpu_kv_cache_budget_mb=2, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=draft, disaggregation_mode=mode)
    mc = ModelConfig.from_path(target)
    par = ParallelState(1, 1, False, 1)
    with scoped(parallel=par):
        simulate_rank(par, 0)
        aux = resolve_spec_aux_hidden_state(sa, mc)
        cfg = KVCacheConfigurator(sa, mc, aux).configure()
        tp = build_pools(cfg, mc, device="cpu")
        dp = build_pools(cfg, aux.draft_model_config, device="cpu", is_draft=True, target_pools=tp)
    return cfg, tp, dp


def test_prefill_node_plan_has_no_verify_columns(tmp_path):
    target, draft = _models(tmp_path)
    normal, t_normal, d_normal = _plan(target, draft, "null")
    prefill, t_prefill, d_prefill = _plan(target, draft, "prefill")
    decode, t_decode, d_decode = _plan(target, draft, "decode")
    assert normal.req_to_token_context_len == decode.req_to_token_context_len
    assert prefill.req_to_token_context_len == normal.req_to_token_context_len - BLOCK
    assert t_prefill.req_to_token_pool.req_to_token.shape[1] == prefill.req_to_token_context_len
    assert prefill.context_len == normal.context_len == CONTEXT
    # The saved bytes go to KV; the per-slot geometry is unchanged, so prefill and decode buffers pair up.
    assert prefill.max_total_num_tokens >= normal.max_total_num_tokens
    assert prefill.target_cell_bytes == decode.target_cell_bytes and prefill.draft_cell_bytes == decode.draft_cell_bytes
    src = transferable_kv_buffers(_Worker(t_prefill, d_prefill))
    dst = transferable_kv_buffers(_Worker(t_decode, d_decode))
    assert [b.name for b in src] == [b.name for b in dst]
    assert [b.item_bytes for b in src] == [b.item_bytes for b in dst]
    assert any(b.name.startswith("draft.") for b in src)  # the draft KV travels in the same transfer
    planned = {p.name: p.planned_bytes for p in prefill.planned_pools()}
    allocated = {**t_prefill.allocated_bytes(), **d_prefill.allocated_bytes()}
    assert planned == allocated
