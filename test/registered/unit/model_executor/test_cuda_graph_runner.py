"""CudaGraphRunner on CPU through the eager-replay graph double (Triton attention under TRITON_INTERPRET=1).

The double re-runs the captured forward over the static buffers, so these tests check what a real
CUDA graph relies on: the captured forward reads only the static buffers and the backend's persistent
metadata, padding up to a bucket changes no real row, and pad requests write no real KV slot. Real
CUDA graphs are exercised by test_cuda_graph_runner_gpu.py.
"""

import logging
import os

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
from sglite.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglite.srt.model_executor.cuda_graph_runner import (
    CudaGraph,
    CudaGraphRunner,
    CudaGraphSpec,
    EagerReplayGraph,
    HostSyncError,
    bucket_for,
    capture_batch_sizes,
    plan_cuda_graphs,
)
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.server_args import ServerArgs
from sglite.testing.greedy_margin import assert_clear_greedy_margins
from sglite.testing.tiny_dflash import TINY_MASK_TOKEN_ID, TinyDraftSpec, build_tiny_dflash_draft, build_tiny_target

SUITE = "unit-cpu"
EST_TIME = 50

BLOCK = 4
BUCKETS = (1, 2, 4)
PROMPTS = [[5, 17, 300, 41, 7], [100, 200, 300], [60, 61, 62, 63, 64, 65, 66, 67, 68]]  # bs 3 -> bucket 4

needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU needs TRITON_INTERPRET=1 (set by test/conftest.py on CPU hosts)",
)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cg_pair")
    target = build_tiny_target(str(d / "target"), seed=3)
    draft = build_tiny_dflash_draft(str(d / "draft"), target, seed=4, spec=TinyDraftSpec(block_size=BLOCK))
    return target, draft


def _args(target_dir, draft_dir=None, backend="triton", **kw):
    base = dict(
        model_path=target_dir, device="cpu", attention_backend=backend, cpu_kv_cache_budget_mb=1,
        max_running_requests=8, context_length=128,
    )
    if draft_dir is not None:
        base.update(speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir)
    base.update(kw)
    return ServerArgs(**base).validate()


def _kv_snapshot(pool):
    return [(pool.get_key_buffer(i).clone(), pool.get_value_buffer(i).clone()) for i in range(pool.layer_num)]


def _assert_only_real_and_pad_slots_changed(pool, before, real_slots, page_size):
    """Every K/V row other than the batch's own slots and the padding page is bitwise unchanged."""
    keep = torch.ones(pool.get_key_buffer(0).shape[0], dtype=torch.bool)
    keep[real_slots] = False
    keep[:page_size] = False
    for i, (k0, v0) in enumerate(before):
        assert torch.equal(pool.get_key_buffer(i)[keep], k0[keep]), f"layer {i}: a K row outside the batch changed"
        assert torch.equal(pool.get_value_buffer(i)[keep], v0[keep]), f"layer {i}: a V row outside the batch changed"


def _prefill(runner, capture=None):
    rows = runner.req_to_token_pool.alloc(len(PROMPTS))
    fb = runner.build_forward_batch(
        ForwardMode.EXTEND, [(r, 0, p) for r, p in zip(rows, PROMPTS)], capture_aux_hidden_layers=capture
    )
    return rows, fb, runner.forward(fb)


# ---------------------------------------------------------------------- pure pieces
def test_batch_size_buckets():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # the cap itself is always captured
    assert capture_batch_sizes(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        capture_batch_sizes(0)
    assert [bucket_for(b, [1, 2, 4, 8, 16]) for b in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="exceeds the largest captured batch 16"):
        bucket_for(17, [1, 2, 4, 8, 16])


def test_eager_replay_double_refreshes_captured_outputs_in_place():
    x = torch.arange(4.0)
    graph = EagerReplayGraph()
    out = graph.capture(lambda: x * 2)
    x.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    graph.replay()
    assert out.tolist() == [10.0, 12.0, 14.0, 16.0] and graph.num_replays == 1
    bad = EagerReplayGraph()
    n = [2]
    bad.capture(lambda: torch.zeros(n[0]))
    n[0] = 3  # a data-dependent shape cannot be replayed by a real graph either
    with pytest.raises(RuntimeError, match="replay produced"):
        bad.replay()
    # Host reads of device values would break (or be baked into) a real capture: the double refuses them.
    for leak in (lambda: x * x.sum().item(), lambda: x[x > 6], lambda: torch.tensor(x.tolist()), lambda: x.nonzero()):
        with pytest.raises(HostSyncError):
            EagerReplayGraph().capture(leak)
    assert x.tolist() == [5.0, 6.0, 7.0, 8.0]  # the guard is gone afterwards


class _Backend:
    def __init__(self, graphs):
        self.supports_cuda_graph = graphs


def _plan(server_args, *, device="cuda", graphs=True, is_draft=False, model_config=None, aux=None, dp=1, max_running=48):
    return plan_cuda_graphs(
        server_args, device_type=device, attn_backend=_Backend(graphs), is_draft=is_draft,
        model_config=model_config, spec_aux_config=aux, max_running_requests=max_running, attn_dp_size=dp,
    )


def test_plan_cuda_graphs(pair_dirs):
    from sglite.srt.configs.model_config import ModelConfig
    from sglite.srt.model_executor.model_runner_components.spec_aux_hidden_state import SpecAuxHiddenStateConfig

    target_dir, draft_dir = pair_dirs
    plain = ServerArgs(model_path=target_dir, device="cuda")
    plan = _plan(plain)
    assert [(s.mode, s.tokens_per_req, s.capture_aux_hidden_layers) for s in plan.specs] == [(ForwardMode.DECODE, 1, None)]
    assert plan.specs[0].batch_sizes == (1, 2, 4, 8, 16, 24, 32)  # --cuda-graph-max-bs 32
    assert _plan(plain, max_running=12).specs[0].batch_sizes == (1, 2, 4, 8, 12)  # never above max running requests
    assert "CUDA-only" in _plan(plain, device="cpu").reason and not _plan(plain, device="cpu").specs
    assert "--disable-cuda-graph" in _plan(ServerArgs(model_path=target_dir, disable_cuda_graph=True)).reason
    assert "does not support CUDA graphs" in _plan(plain, graphs=False).reason
    dp = ServerArgs(model_path=target_dir, tp_size=2, dp_size=2, enable_dp_attention=True)
    assert "--enable-dp-attention" in _plan(dp, dp=2).reason
    assert "prefill" in _plan(ServerArgs(model_path=target_dir, disaggregation_mode="prefill")).reason

    spec = ServerArgs(model_path=target_dir, speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir)
    draft_cfg = ModelConfig.from_path(draft_dir)
    # The widths come from the spec config's one resolution of B (DSPARK-style: B drafts, B+1 verified).
    aux = SpecAuxHiddenStateConfig(
        algorithm="DFLASH", target_layer_ids=(1, 2), draft_block_size=BLOCK, num_proposed_drafts=BLOCK
    )
    (verify,) = _plan(spec, aux=aux).specs
    assert (verify.mode, verify.tokens_per_req, verify.capture_aux_hidden_layers) == (
        ForwardMode.TARGET_VERIFY, BLOCK + 1, (1, 2))
    (block,) = _plan(spec, is_draft=True, model_config=draft_cfg, aux=aux).specs
    assert (block.mode, block.tokens_per_req, block.capture_aux_hidden_layers) == (ForwardMode.DRAFT_BLOCK, BLOCK, None)
    with pytest.raises(ValueError, match="DECODE graphs take one token"):
        CudaGraphSpec(ForwardMode.DECODE, 2, (1,))
    with pytest.raises(ValueError, match="not EXTEND"):
        CudaGraphSpec(ForwardMode.EXTEND, 1, (1,))


def test_cpu_runner_builds_no_graphs_and_torch_native_cannot_be_captured(pair_dirs, rank0, caplog):
    from sglite.srt.model_executor import cuda_graph_runner

    target_dir, _ = pair_dirs
    cuda_graph_runner._LOGGED_OFF_REASONS.clear()
    with caplog.at_level(logging.INFO, logger="sglite.srt.model_executor.cuda_graph_runner"):
        runner = ModelRunner(_args(target_dir, backend="torch_native"))
        destroy_parallel_runtime()
        again = ModelRunner(_args(target_dir, backend="torch_native"))
    assert runner.cuda_graph_runners == [] and again.cuda_graph_runners == []
    off = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CUDA graphs off")]
    assert off == ["CUDA graphs off: device is cpu; CUDA graphs are CUDA-only"]  # logged once per process
    with pytest.raises(ValueError, match="TorchNativeAttnBackend cannot be captured"):
        CudaGraphRunner(runner, CudaGraphSpec(ForwardMode.DECODE, 1, BUCKETS), graph_factory=EagerReplayGraph)


# ---------------------------------------------------------------------- graph runner vs eager forward
@needs_triton
def test_decode_graph_equals_eager_with_padding(pair_dirs, rank0):
    target_dir, _ = pair_dirs
    runner = ModelRunner(_args(target_dir))
    assert runner.cuda_graph_runners == []  # CPU: ModelRunner never builds graphs itself
    graphs = CudaGraphRunner(runner, CudaGraphSpec(ForwardMode.DECODE, 1, BUCKETS), graph_factory=EagerReplayGraph)
    with pytest.raises(ValueError, match="need a CUDA device"):
        CudaGraphRunner(runner, CudaGraphSpec(ForwardMode.DECODE, 1, BUCKETS), graph_factory=CudaGraph)
    rows, _, out = _prefill(runner)
    seq = [len(p) for p in PROMPTS]
    tokens = out.next_token_logits.argmax(-1).tolist()
    pool = runner.token_to_kv_pool
    for step in range(3):
        fb = runner.build_forward_batch(ForwardMode.DECODE, [(r, s, [t]) for r, s, t in zip(rows, seq, tokens)])
        eager = runner.forward(fb)
        assert graphs.can_run(fb)
        before = _kv_snapshot(pool)
        for i in range(pool.layer_num):  # poison the padding slot: the pad request must write it
            pool.get_key_buffer(i)[0].fill_(7.0)
        graphed = graphs.replay(fb)
        assert graphed.next_token_logits.shape == eager.next_token_logits.shape == (3, 512)
        torch.testing.assert_close(graphed.next_token_logits, eager.next_token_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graphed.hidden_states, eager.hidden_states, atol=1e-5, rtol=1e-5)
        _assert_only_real_and_pad_slots_changed(pool, before, fb.out_cache_loc, runner.token_to_kv_pool_allocator.page_size)
        assert not torch.equal(pool.get_key_buffer(0)[0], torch.full_like(pool.get_key_buffer(0)[0], 7.0))
        tokens = graphed.next_token_logits.argmax(-1).tolist()
        seq = [s + 1 for s in seq]
    assert graphs.graphs[4].num_replays == 3
    # Every bucket's graph writes one set of output buffers (one largest-bucket logits tensor per runner).
    assert len({graphs.outputs[b].next_token_logits.data_ptr() for b in BUCKETS}) == 1
    # One request runs in the bucket of one, and the same graph runner keeps serving both buckets.
    fb1 = runner.build_forward_batch(ForwardMode.DECODE, [(rows[0], seq[0], [tokens[0]])])
    torch.testing.assert_close(graphs.replay(fb1).next_token_logits, runner.forward(fb1).next_token_logits, atol=1e-5, rtol=1e-5)


@needs_triton
def test_can_run_rejects_what_no_graph_fits(pair_dirs, rank0):
    target_dir, _ = pair_dirs
    runner = ModelRunner(_args(target_dir, max_running_requests=16))
    graphs = CudaGraphRunner(runner, CudaGraphSpec(ForwardMode.DECODE, 1, (1, 2)), graph_factory=EagerReplayGraph)
    rows = runner.req_to_token_pool.alloc(3)
    fb = runner.build_forward_batch(ForwardMode.DECODE, [(r, 0, [9]) for r in rows[:2]])
    assert graphs.can_run(fb)
    assert not graphs.can_run(runner.build_forward_batch(ForwardMode.DECODE, [(r, 0, [9]) for r in rows]))  # bs 3 > 2
    assert not graphs.can_run(runner.build_forward_batch(ForwardMode.EXTEND, [(rows[0], 0, [1, 2])]))
    fb.attn_backend = TorchNativeAttnBackend(runner)
    assert not graphs.can_run(fb)  # another backend (not graph-safe) runs eagerly
    fb.attn_backend = runner.attn_backend
    fb.capture_aux_hidden_layers = [0]
    assert not graphs.can_run(fb)  # the DECODE graph captured no aux layers
    fb.capture_aux_hidden_layers = None
    fb.input_embeds = torch.zeros(2, 64)
    assert not graphs.can_run(fb)


@needs_triton
def test_dflash_verify_and_draft_block_graphs_equal_eager(pair_dirs, rank0):
    target_dir, draft_dir = pair_dirs
    args = _args(target_dir, draft_dir)
    target = ModelRunner(args)
    draft = ModelRunner(args, is_draft=True, target_runner=target)
    layers = list(target.spec_aux_config.target_layer_ids)
    verify_graphs = CudaGraphRunner(
        target, CudaGraphSpec(ForwardMode.TARGET_VERIFY, BLOCK, BUCKETS, tuple(layers)), graph_factory=EagerReplayGraph
    )
    block_graphs = CudaGraphRunner(draft, CudaGraphSpec(ForwardMode.DRAFT_BLOCK, BLOCK, BUCKETS), graph_factory=EagerReplayGraph)
    rows, pre_fb, pre_out = _prefill(target, capture=layers)
    draft.model.write_context_kv(pre_out.aux_hidden_states, pre_fb.positions, pre_fb.out_cache_loc, draft.token_to_kv_pool)
    anchors = pre_out.next_token_logits.argmax(-1).tolist()
    prefix = [len(p) for p in PROMPTS]
    page = target.token_to_kv_pool_allocator.page_size

    block_fb = draft.build_forward_batch(
        ForwardMode.DRAFT_BLOCK, [(r, p, [c] + [TINY_MASK_TOKEN_ID] * (BLOCK - 1)) for r, p, c in zip(rows, prefix, anchors)]
    )
    eager_block = draft.forward(block_fb)
    assert block_graphs.can_run(block_fb) and not verify_graphs.can_run(block_fb)
    before = _kv_snapshot(draft.token_to_kv_pool)
    graphed_block = block_graphs.replay(block_fb)
    assert graphed_block.next_token_logits.shape == (3 * BLOCK, 512)
    torch.testing.assert_close(graphed_block.next_token_logits, eager_block.next_token_logits, atol=1e-5, rtol=1e-5)
    _assert_only_real_and_pad_slots_changed(draft.token_to_kv_pool, before, block_fb.out_cache_loc, page)
    drafts = draft.model.propose_drafts(graphed_block, block_fb, BLOCK).ids
    assert torch.equal(drafts, draft.model.propose_drafts(eager_block, block_fb, BLOCK).ids)

    # Verify [c, d1..d3] in the same slots, capturing the draft's target layers.
    verify_items = [(r, p, [c] + d) for r, p, c, d in zip(rows, prefix, anchors, drafts.tolist())]
    verify_fb = target.build_forward_batch(
        ForwardMode.TARGET_VERIFY, verify_items, out_cache_loc=block_fb.out_cache_loc, capture_aux_hidden_layers=layers
    )
    eager_verify = target.forward(verify_fb)
    assert verify_graphs.can_run(verify_fb)
    before = _kv_snapshot(target.token_to_kv_pool)
    graphed_verify = verify_graphs.replay(verify_fb)
    assert graphed_verify.aux_hidden_states.shape == eager_verify.aux_hidden_states.shape == (3 * BLOCK, 2 * 64)
    torch.testing.assert_close(graphed_verify.next_token_logits, eager_verify.next_token_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graphed_verify.aux_hidden_states, eager_verify.aux_hidden_states, atol=1e-5, rtol=1e-5)
    _assert_only_real_and_pad_slots_changed(target.token_to_kv_pool, before, verify_fb.out_cache_loc, page)
    # A verify batch without the aux layers, or with another block size, is not this graph's shape.
    verify_fb.capture_aux_hidden_layers = None
    assert not verify_graphs.can_run(verify_fb)
    short = target.build_forward_batch(ForwardMode.TARGET_VERIFY, [(rows[0], prefix[0], [1, 2])], capture_aux_hidden_layers=layers)
    assert not verify_graphs.can_run(short)


# ---------------------------------------------------------------------- wired into ModelRunner / DFlashWorker
@needs_triton
def test_model_runner_forward_uses_its_graph_runner(pair_dirs, rank0):
    """Greedy decoding through ModelRunner.forward with a (double) graph runner attached equals transformers."""
    from sglite.testing.runner_generate import greedy_generate, hf_greedy
    from sglite.testing.tiny_models import load_hf_model

    target_dir, _ = pair_dirs
    runner = ModelRunner(_args(target_dir))
    graphs = CudaGraphRunner(runner, CudaGraphSpec(ForwardMode.DECODE, 1, BUCKETS), graph_factory=EagerReplayGraph)
    runner.cuda_graph_runners = [graphs]
    hf = load_hf_model(target_dir)
    expected = hf_greedy(hf, PROMPTS, 5)
    assert_clear_greedy_margins(hf, PROMPTS, expected)
    assert greedy_generate(runner, PROMPTS, 5) == expected
    assert graphs.num_replays == 4  # every decode step (bs 3, bucket 4) went through the graph runner


@needs_triton
def test_dflash_worker_through_graph_runners_is_lossless(pair_dirs, rank0):
    """DFLASH greedy with verify and draft-block forwards served by (double) graph runners equals target greedy."""
    from sglite.srt.managers.scheduler import Scheduler
    from sglite.srt.speculative.dflash_worker import create_dflash_worker
    from sglite.testing.runner_generate import hf_greedy, scheduler_greedy_generate
    from sglite.testing.tiny_models import load_hf_model

    target_dir, draft_dir = pair_dirs
    args = _args(target_dir, draft_dir)
    worker = create_dflash_worker(args)
    target, draft = worker.target_runner, worker.draft_runner
    layers = tuple(worker.capture_layers)
    sizes = (2, 4)  # bs 3 (and 1 once a request finishes early) run padded
    verify = CudaGraphRunner(target, CudaGraphSpec(ForwardMode.TARGET_VERIFY, BLOCK, sizes, layers), graph_factory=EagerReplayGraph)
    block = CudaGraphRunner(draft, CudaGraphSpec(ForwardMode.DRAFT_BLOCK, BLOCK, sizes), graph_factory=EagerReplayGraph)
    target.cuda_graph_runners, draft.cuda_graph_runners = [verify], [block]
    prompts = PROMPTS  # bs 3: bucket 4
    got = scheduler_greedy_generate(Scheduler(args, worker), prompts, 5)
    hf = load_hf_model(target_dir)
    expected = hf_greedy(hf, prompts, 5)
    assert_clear_greedy_margins(hf, prompts, expected)
    assert got == expected
    assert verify.num_replays > 0 and block.num_replays == verify.num_replays
