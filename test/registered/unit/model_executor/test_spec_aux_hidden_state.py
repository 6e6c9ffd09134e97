"""Draft resolver: capture layers, draft layer count, and the draft's KV price at the live attn_tp_size.

The seeds' case (issue 3): an 8-KV-head, 5-layer, head_dim-128, bf16 DFLASH draft costs
8*256*5*2 = 20480 B/token/rank under tp16/dp16 with DP attention (attn_tp 1) and 1 head (2560) without.
"""

SUITE = "unit-cpu"
EST_TIME = 8

import json
import os

import pytest
import torch

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.distributed.bootstrap import simulate_rank
from sglite.srt.model_executor.model_runner_components import spec_aux_hidden_state as sah
from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
    DraftResolutionError,
    _resolve_dflash_aux_hidden_state,
    resolve_spec_aux_hidden_state,
)
from sglite.srt.mem_cache.pool_plan import attn_pool_geometry
from sglite.srt.runtime_context import ParallelNotInitializedError, ParallelState, scoped
from sglite.srt.server_args import ServerArgs

# The repo's copies of shared/model_configs (identical files), so a fresh clone anywhere finds them.
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "model_configs")


def _load(name):
    return ModelConfig.from_path(os.path.join(CONFIGS, name))


def _target():
    return _load("qwen3-8b.json")


def _seed_draft_raw(**over):
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "intermediate_size": 12288,
        "torch_dtype": "bfloat16",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }
    raw.update(over)
    return raw


def _args(algo="DFLASH", tp=1, dp=1, dpa=False, cp=1, **kw):
    return ServerArgs(
        model_path="unused", speculative_algorithm=algo, speculative_draft_model_path="unused-draft",
        tp_size=tp, dp_size=dp, enable_dp_attention=dpa, attn_cp_size=cp, **kw,
    )


def _resolve_at(args, draft, rank=0, target=None):
    par = ParallelState(args.tp_size, args.dp_size, args.enable_dp_attention, args.attn_cp_size)
    with scoped(parallel=par):
        simulate_rank(par, rank)
        return resolve_spec_aux_hidden_state(args, target or _target(), draft_model_config=draft)


@pytest.mark.parametrize(
    "tp,dp,dpa,cp,expected_bytes",
    [
        (16, 16, True, 1, 8 * 256 * 5 * 2),  # attn_tp 1: all 8 heads on every rank
        (16, 16, False, 1, 1 * 256 * 5 * 2),  # attn_tp 16: heads replicate, 1 per rank
        (16, 2, True, 1, 1 * 256 * 5 * 2),  # attn_tp 8: 1 head
        (16, 4, True, 1, 2 * 256 * 5 * 2),  # attn_tp 4: 2 heads
        (16, 8, True, 2, 8 * 256 * 5 * 2),  # attn_tp 1 with cp 2
        (1, 1, False, 1, 8 * 256 * 5 * 2),
    ],
)
def test_seed_case_draft_bytes_per_token(tp, dp, dpa, cp, expected_bytes):
    draft = ModelConfig.from_dict(_seed_draft_raw())
    for rank in (0, tp - 1):
        aux = _resolve_at(_args(tp=tp, dp=dp, dpa=dpa, cp=cp), draft, rank)
        assert aux.draft_cell_bytes == expected_bytes
        assert aux.draft_num_layers == 5
        assert aux.target_layer_ids == (1, 9, 17, 25, 33)
        assert aux.draft_kv_cache_dtype == torch.bfloat16


class _RecordingDraft(ModelConfig):
    """A draft config that records every width its KV heads are asked for."""

    seen: list

    def get_num_kv_heads(self, attn_tp_size):
        self.seen.append(attn_tp_size)
        return super().get_num_kv_heads(attn_tp_size)


def _recording_draft():
    d = ModelConfig.from_dict(_seed_draft_raw())
    d.__class__ = _RecordingDraft
    d.seen = []
    return d


@pytest.mark.parametrize("tp,dp,dpa,width", [(16, 16, True, 1), (16, 1, False, 16), (8, 2, True, 4), (16, 8, True, 2)])
def test_resolver_prices_at_attn_tp_not_tp(tp, dp, dpa, width):
    # Regression for the tp_size bug (sglang #38202): the width handed to the draft's get_num_kv_heads
    # must be the attention-TP width the pool builders use, never tp_size.
    d = _recording_draft()
    _resolve_at(_args(tp=tp, dp=dp, dpa=dpa), d)
    assert d.seen, "the resolver never asked the draft for its per-rank KV heads"
    assert sorted(set(d.seen)) == [width]


def test_resolver_before_parallel_init_raises_with_context():
    par = ParallelState(16, 16, True, 1)  # configured but not stamped
    with scoped(parallel=par):
        with pytest.raises(ParallelNotInitializedError, match="resolve_spec_aux_hidden_state"):
            resolve_spec_aux_hidden_state(_args(tp=16, dp=16, dpa=True), _target(),
                                          draft_model_config=ModelConfig.from_dict(_seed_draft_raw()))


def test_draft_price_is_the_draft_pool_geometry():
    # heads(attn_tp) * (head_dim + v_head_dim) * layers * dtype bytes, computed once by the pool geometry.
    d = ModelConfig.from_dict(_seed_draft_raw())
    assert attn_pool_geometry(d, range(5), torch.bfloat16, 1).cell_bytes() == 20480
    assert attn_pool_geometry(d, range(5), torch.float8_e4m3fn, 1).cell_bytes() == 10240
    assert attn_pool_geometry(d, range(5), torch.bfloat16, 2).cell_bytes() == 10240
    aux = _resolve_at(_args(tp=2, dp=1), d)
    assert aux.draft_geometry == attn_pool_geometry(d, range(5), torch.bfloat16, 2)
    assert aux.draft_cell_bytes == aux.draft_geometry.cell_bytes() == 10240


def test_real_dflash_and_dspark_drafts():
    for name, algo in (("qwen3-8b-dflash-b16.json", "DFLASH"), ("dspark-qwen3-8b-block7.json", "DSPARK")):
        aux = _resolve_at(_args(algo=algo), _load(name))
        assert aux.algorithm == algo and aux.is_dflash_family
        assert aux.target_layer_ids == (1, 9, 17, 25, 33)  # README: both drafts read these Qwen3-8B layers
        assert aux.draft_cell_bytes == 8 * 256 * 5 * 2
        assert aux.draft_total_kv_heads == 8


def test_draft_kv_dtype_override():
    aux = _resolve_at(_args(speculative_draft_kv_cache_dtype="fp8_e4m3"), ModelConfig.from_dict(_seed_draft_raw()))
    assert aux.draft_kv_cache_dtype == torch.float8_e4m3fn
    assert aux.draft_cell_bytes == 8 * 256 * 5 * 1


def test_no_speculation_is_empty():
    par = ParallelState()
    with scoped(parallel=par):
        simulate_rank(par, 0)
        aux = resolve_spec_aux_hidden_state(ServerArgs(), _target())
    assert not aux.has_draft and aux.draft_cell_bytes is None and aux.draft_geometry is None


# ---------------------------------------------------------------- unresolvable drafts stop with a message


def _write(tmp_path, raw):
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


def test_missing_target_layers_field(tmp_path):
    raw = _seed_draft_raw(dflash_config={"mask_token_id": 1})
    path = _write(tmp_path, raw)
    args = _args()
    args.speculative_draft_model_path = path
    par = ParallelState()
    with scoped(parallel=par):
        simulate_rank(par, 0)
        with pytest.raises(DraftResolutionError, match="target_layer_ids"):
            resolve_spec_aux_hidden_state(args, _target())


def test_missing_config_json(tmp_path):
    args = _args()
    args.speculative_draft_model_path = str(tmp_path / "nowhere")
    par = ParallelState()
    with scoped(parallel=par):
        simulate_rank(par, 0)
        with pytest.raises(DraftResolutionError, match="config.json"):
            resolve_spec_aux_hidden_state(args, _target())


def test_unknown_draft_dtype():
    with pytest.raises(DraftResolutionError, match="speculative-draft-kv-cache-dtype"):
        _resolve_at(_args(speculative_draft_kv_cache_dtype="fp4_magic"), ModelConfig.from_dict(_seed_draft_raw()))


def test_not_a_block_diffusion_draft():
    with pytest.raises(DraftResolutionError, match="not a DFLASH/DSPARK draft"):
        _resolve_at(_args(), _load("qwen3-8b.json"))


def test_draft_for_another_target():
    llama = _load("llama-3.1-8b-instruct.json")  # 32 layers: layer 33 does not exist
    with pytest.raises(DraftResolutionError, match="outside the target"):
        _resolve_at(_args(), ModelConfig.from_dict(_seed_draft_raw()), target=llama)
    with pytest.raises(DraftResolutionError, match="trained for another target"):
        _resolve_at(_args(algo="DSPARK"), _load("dspark-qwen3-8b-block7.json"), target=llama)


def test_aux_layer_helper():
    ids, n = _resolve_dflash_aux_hidden_state("DFLASH", ModelConfig.from_dict(_seed_draft_raw()), _target())
    assert ids == [1, 9, 17, 25, 33] and n == 5


# ---------------------------------------------------------------- EAGLE / STANDALONE


def _eagle_draft(**over):
    raw = json.load(open(os.path.join(CONFIGS, "qwen3-8b.json")))
    raw.update({"num_hidden_layers": 1}, **over)
    return ModelConfig.from_dict(raw)


def test_eagle_layer_count_and_geometry_check():
    aux = _resolve_at(_args(algo="EAGLE"), _eagle_draft())
    assert aux.draft_num_layers == 1 and aux.draft_geometry.num_layers == 1 and not aux.is_dflash_family
    with pytest.raises(DraftResolutionError, match="geometry"):
        _resolve_at(_args(algo="EAGLE"), _eagle_draft(num_key_value_heads=4))
    mtp = _eagle_draft(num_nextn_predict_layers=2)
    assert _resolve_at(_args(algo="STANDALONE"), mtp).draft_num_layers == 2


def test_module_reads_the_live_width_only():
    # The resolver module must not read tp_size anywhere (the #38202 bug was tp_size=get_parallel().tp_size).
    src = open(sah.__file__).read()
    assert ".tp_size" not in src


@pytest.mark.parametrize(
    "draft_file, algo, flags, expected",
    [
        # (B, drafts per verify); the verify width is drafts + 1.
        ("qwen3-8b-dflash-b16.json", "DFLASH", {}, (16, 15)),
        ("qwen3-8b-dflash-b16.json", "DFLASH", {"speculative_num_draft_tokens": 8}, (8, 7)),
        ("dspark-qwen3-8b-block7.json", "DSPARK", {}, (7, 7)),  # sample_from_anchor: B drafts, B+1 verified
        ("dspark-qwen3-8b-block7.json", "DSPARK", {"speculative_num_draft_tokens": 6}, (5, 5)),
        ("dspark-qwen3-8b-block7.json", "DSPARK", {"speculative_dspark_block_size": 4}, (4, 4)),
    ],
)
def test_block_is_resolved_once_into_the_spec_config(draft_file, algo, flags, expected):
    """B lives in the spec config; the KV plan's verify columns and the CUDA-graph widths read it."""
    from types import SimpleNamespace

    from sglite.srt.model_executor.kv_cache_configurator import KVCacheConfigurator
    from sglite.srt.model_executor.cuda_graph_runner import plan_cuda_graphs
    from sglite.srt.model_executor.forward_batch_info import ForwardMode

    args = _args(algo=algo, device="cuda", **flags)
    aux = _resolve_at(args, _load(draft_file))
    assert (aux.draft_block_size, aux.num_proposed_drafts, aux.num_verify_tokens) == (*expected, expected[1] + 1)
    assert KVCacheConfigurator(args, _target(), aux, model_dtype=torch.bfloat16)._num_draft_tokens() == aux.num_verify_tokens
    graphs = dict(device_type="cuda", attn_backend=SimpleNamespace(supports_cuda_graph=True), model_config=None,
                  spec_aux_config=aux, max_running_requests=8)
    (verify,) = plan_cuda_graphs(args, is_draft=False, **graphs).specs
    (block,) = plan_cuda_graphs(args, is_draft=True, **graphs).specs
    assert (verify.mode, verify.tokens_per_req) == (ForwardMode.TARGET_VERIFY, aux.num_verify_tokens)
    assert (block.mode, block.tokens_per_req) == (ForwardMode.DRAFT_BLOCK, aux.draft_block_size)


def test_block_flags_that_disagree_are_refused():
    with pytest.raises(DraftResolutionError, match="disagrees with block size 4"):
        _resolve_at(_args(algo="DSPARK", speculative_num_draft_tokens=7, speculative_dspark_block_size=4),
                    _load("dspark-qwen3-8b-block7.json"))
    with pytest.raises(DraftResolutionError, match="at least one"):
        _resolve_at(_args(speculative_num_draft_tokens=1), _load("qwen3-8b-dflash-b16.json"))
