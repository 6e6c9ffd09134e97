"""--enable-torch-compile: the compiled decode step against the eager forward, its dispatch, and its refusals."""

from types import SimpleNamespace

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime
from sglite.srt.model_executor.compiled_decode_runner import (
    PROMPT_TOKEN_BREAK_EVEN_KEYS,
    CompiledDecodeError,
    check_compiled_decode_supported,
    compiled_extend_pays,
    cpp_compiler,
)
from sglite.srt.model_executor.forward_batch_info import ForwardMode
from sglite.srt.model_executor.model_runner import ModelRunner
from sglite.srt.server_args import ServerArgs, ServerArgsError
from sglite.testing.tiny_dflash import TinyDraftSpec, build_tiny_dflash_draft, build_tiny_target

SUITE = "unit-cpu"
EST_TIME = 90  # Inductor compiles of a 4-layer model (two graphs per runner: decode, and the token graph)

PROMPTS = [[5, 17, 300, 41, 7], [100, 200, 300], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
LOGITS_ATOL = 1e-4  # fused fp32 arithmetic in another order: not bit-identical to eager


needs_cxx = pytest.mark.skipif(cpp_compiler() is None, reason="Inductor's CPU backend needs g++ (or $CXX)")


@pytest.fixture(autouse=True)
def fresh_dynamo_cache():
    """Each test's runners start from an empty Dynamo cache: the model body's code object is shared by every runner
    of the process, and this module builds more kinds of runner (kernel or not, captures, dtypes) than the
    per-code-object recompile limit of 8 that one server process never approaches (2 graphs)."""
    torch._dynamo.reset()
    yield


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("compiled_pair")
    target = build_tiny_target(str(d / "target"), seed=7)
    draft = build_tiny_dflash_draft(str(d / "draft"), target, seed=8, spec=TinyDraftSpec(block_size=4))
    return target, draft


def _args(target, **kw):
    return ServerArgs(
        model_path=target, device="cpu", cpu_kv_cache_budget_mb=1, max_running_requests=8, context_length=128,
        enable_torch_compile=True, torch_compile_max_bs=4, **kw,
    ).validate()


def _eager(runner, fb):
    fb.attn_backend.init_forward_metadata(fb)
    return runner.model.forward(fb.input_ids, fb.positions, fb)


def _decode_both_ways(runner, steps: int, capture=None):
    """Greedy decode of PROMPTS; each step through the compiled graph and eagerly on the same slots."""
    rows = runner.req_to_token_pool.alloc(len(PROMPTS))
    out = runner.forward(runner.build_forward_batch(ForwardMode.EXTEND, list(zip(rows, [0] * 3, PROMPTS))))
    nxt, lens = out.next_token_logits.argmax(-1).tolist(), [len(p) for p in PROMPTS]
    for step in range(steps):
        # Batches built as a worker builds them (under inference mode) and as a test does: one graph serves both.
        with torch.inference_mode(step % 2 == 0):
            fb = runner.build_forward_batch(
                ForwardMode.DECODE, [(r, n, [t]) for r, n, t in zip(rows, lens, nxt)], capture_aux_hidden_layers=capture
            )
        ref = _compiled_equals_eager(runner, fb, capture)
        nxt, lens = ref.next_token_logits.argmax(-1).tolist(), [n + 1 for n in lens]
    return rows


def _compiled_equals_eager(runner, fb, capture=None):
    """Run ``fb`` compiled, then eagerly on the same slots; assert they agree and return the eager output."""
    assert runner.compiled_decode.can_run(fb)
    got = runner.forward(fb)  # compiled (K/V written by the graph)
    ref = _eager(runner, fb)  # rewrites the same slots with the same K/V
    torch.testing.assert_close(got.next_token_logits, ref.next_token_logits, atol=LOGITS_ATOL, rtol=0)
    if capture:
        torch.testing.assert_close(got.aux_hidden_states, ref.aux_hidden_states, atol=LOGITS_ATOL, rtol=0)
    assert got.next_token_logits.argmax(-1).tolist() == ref.next_token_logits.argmax(-1).tolist()
    return ref


@needs_cxx
def test_compiled_decode_equals_eager_and_runs_only_what_it_serves(pair_dirs, rank0):
    runner = ModelRunner(_args(pair_dirs[0]))
    assert runner.compiled_decode is not None
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rows = _decode_both_ways(runner, steps=6)
    for n in (20, 21):  # batch 1 (Dynamo would specialise a backed size-1 dim): the same graph
        _compiled_equals_eager(runner, runner.build_forward_batch(ForwardMode.DECODE, [(rows[0], n, [3])]))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the start-up graph served them all
    many = runner.build_forward_batch(ForwardMode.DECODE, [(r, 1, [3]) for r in runner.req_to_token_pool.alloc(5)])
    assert not runner.compiled_decode.can_run(many)  # above --torch-compile-max-bs 4: eager


@needs_cxx
@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpp-kernel", "torch-attention"])
def test_prefills_and_mixed_steps_run_through_the_token_graph(pair_dirs, rank0, monkeypatch, use_kernel):
    """Prompts of one length or of several, on a cached prefix or not, batch 1 too, and mixed steps (prompt chunks
    beside decode rows) run compiled, equal to eager, with no compile on live traffic. With the C++ attention kernel
    every prefill does; with the torch formulation (no kernel for the dtype or heads) the cost model keeps long
    prompts eager, and so does the scores budget."""
    import sglite.srt.model_executor.compiled_decode_runner as cdr

    if not use_kernel:
        monkeypatch.setattr(cdr, "attention_kernel_serves", lambda model, dtype: False)
    runner = ModelRunner(_args(pair_dirs[0]))
    assert runner.compiled_decode.attention.use_kernel == use_kernel
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rows = runner.req_to_token_pool.alloc(4)
    cases = [  # (prefix, new tokens) per request
        [(0, 9)] * 3,
        [(0, 5)],
        [(9, 4)] * 3,
        [(13, 2)] * 2,
        [(0, 7), (0, 3), (0, 12)],  # prompts of different lengths
        [(0, 6), (15, 1), (22, 1), (4, 1)],  # a mixed step: a new prompt and three decode rows
        [(30, 8), (31, 1)],  # a chunk on a cached prefix beside a decode row
        [(0, 60), (40, 1), (41, 1), (42, 1)],  # a prompt past the break-even keys, paid for by three decode rows
    ]
    for case in cases:
        reqs = []
        for r, (prefix, width) in enumerate(case):
            prompt = [(7 * r + i) % 250 + 3 for i in range(prefix + width)]
            reqs.append((rows[r], prefix, prompt[prefix:]))
        fb = runner.build_forward_batch(ForwardMode.EXTEND, reqs)
        assert fb.forward_mode == ForwardMode.EXTEND
        _compiled_equals_eager(runner, fb)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    long_prompt = runner.build_forward_batch(ForwardMode.EXTEND, [(rows[0], 0, list(range(3, 63)))])
    if use_kernel:
        _compiled_equals_eager(runner, long_prompt)  # no cost model, no scores budget: the kernel tiles nothing
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        monkeypatch.setattr(cdr, "MAX_ATTENTION_SCORES", 0)
        monkeypatch.setattr(cdr, "MAX_WIDENED_KV_ELEMENTS", 0)  # an fp32 pool is read in place
        assert runner.compiled_decode.can_run(long_prompt)
        return
    assert not runner.compiled_decode.can_run(long_prompt)  # 60 keys a prompt token, no decode rows: eager
    fb = runner.build_forward_batch(ForwardMode.EXTEND, [(rows[0], 0, [3, 4, 5, 6])])
    heads = runner.model.config.num_attention_heads
    monkeypatch.setattr(cdr, "MAX_ATTENTION_SCORES", 4 * 4 * heads - 1)
    assert not runner.compiled_decode.can_run(fb)
    monkeypatch.setattr(cdr, "MAX_ATTENTION_SCORES", 4 * 4 * heads)
    assert runner.compiled_decode.can_run(fb)


@needs_cxx
def test_a_bf16_model_runs_every_prefill_compiled_through_the_kernel(pair_dirs, rank0, monkeypatch):
    """--dtype bfloat16: bf16 K/V rows widened for the kernel, so prefills and mixed steps of any length run compiled
    (no cost model) and agree with eager within bf16 rounding, with no compile on live traffic; a forward whose widened
    rows would pass the budget runs eagerly."""
    import sglite.srt.model_executor.compiled_decode_runner as cdr

    runner = ModelRunner(_args(pair_dirs[0], dtype="bfloat16"))
    assert runner.token_to_kv_pool.get_key_buffer(0).dtype == torch.bfloat16
    assert runner.compiled_decode.attention.use_kernel
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rows = runner.req_to_token_pool.alloc(4)
    for case in ([(0, 9)] * 3, [(0, 7), (0, 3), (0, 12)], [(0, 6), (15, 1), (22, 1), (4, 1)], [(0, 60)]):
        reqs = [(rows[r], prefix, [(7 * r + i) % 250 + 3 for i in range(width)]) for r, (prefix, width) in enumerate(case)]
        fb = runner.build_forward_batch(ForwardMode.EXTEND, reqs)
        assert runner.compiled_decode.can_run(fb)
        got = runner.forward(fb).next_token_logits.float()
        ref = _eager(runner, fb).next_token_logits.float()
        # bf16 activations: the compiled graph rounds in other places than eager does
        torch.testing.assert_close(got, ref, rtol=0, atol=0.05 * ref.abs().max().item())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    k, v = runner.token_to_kv_pool.get_kv_buffer(0)
    widened = 60 * k.shape[1] * (k.shape[2] + v.shape[2])  # the last case: one request, 60 keys
    monkeypatch.setattr(cdr, "MAX_WIDENED_KV_ELEMENTS", widened)
    assert runner.compiled_decode.can_run(fb)
    monkeypatch.setattr(cdr, "MAX_WIDENED_KV_ELEMENTS", widened - 1)
    assert not runner.compiled_decode.can_run(fb)


def test_compiled_extend_pays_by_the_measured_cost_model():
    # Prompts alone: up to the break-even key count.
    assert compiled_extend_pays([32] * 8, 32) and compiled_extend_pays([PROMPT_TOKEN_BREAK_EVEN_KEYS], 48)
    assert not compiled_extend_pays([64], 64) and not compiled_extend_pays([1024], 1024)
    # Mixed steps: decode rows pay for the prompt tokens' extra keys (the measured SmolLM2 cells).
    assert compiled_extend_pays([32] + [1] * 7, 64)  # 1.04x compiled
    assert compiled_extend_pays([96] + [1] * 31, 192)  # 1.09x
    assert not compiled_extend_pays([64] + [1] * 7, 128)  # 0.98x
    assert not compiled_extend_pays([96] + [1] * 7, 192)  # 0.89x
    assert compiled_extend_pays([1] * 5, 4000)  # one new token a request: decode rows only


@needs_cxx
def test_dflash_target_compiles_its_capturing_decode(pair_dirs, rank0):
    target, draft = pair_dirs
    runner = ModelRunner(_args(target, speculative_algorithm="DFLASH", speculative_draft_model_path=draft))
    capture = [int(i) for i in runner.spec_aux_config.target_layer_ids]
    rows = _decode_both_ways(runner, steps=3, capture=capture)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Verify blocks of several widths (cap-accept cuts them), batch 1 among them: the start-up verify graph.
    for width, reqs in ((4, 3), (2, 3), (3, 1)):
        lens = [len(p) + 3 for p in PROMPTS]  # the decode steps' keys
        fb = runner.build_forward_batch(
            ForwardMode.TARGET_VERIFY, [(r, n, [7, 8, 9, 10][:width]) for r, n in zip(rows[:reqs], lens)],
            capture_aux_hidden_layers=capture,
        )
        assert fb.forward_mode == ForwardMode.TARGET_VERIFY
        _compiled_equals_eager(runner, fb, capture)
    # A draft-free step decodes into the first of each request's block slots: a strided out_cache_loc, whose
    # stride a copy keeps when it has one element (a "dense" tensor to torch's preserve_format).
    for reqs in (1, 3):
        block_slots = runner.token_to_kv_pool_allocator.alloc(reqs * 4).view(reqs, 4)
        lens = [len(p) + 3 for p in PROMPTS[:reqs]]
        fb = runner.build_forward_batch(
            ForwardMode.DECODE, [(r, n, [7]) for r, n in zip(rows, lens)], out_cache_loc=block_slots[:, 0],
            capture_aux_hidden_layers=capture,
        )
        assert fb.out_cache_loc.stride() == (4,)
        _compiled_equals_eager(runner, fb, capture)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no compile on live traffic
    drafter = ModelRunner(
        _args(target, speculative_algorithm="DFLASH", speculative_draft_model_path=draft), is_draft=True,
        target_runner=runner,
    )
    assert drafter.compiled_decode is None  # a draft never decodes


def _no_dynamo(*args, **kwargs):
    raise AssertionError("a forward went through Dynamo's cache lookup")


def _forwards_equal_eager(runner, capture=None):
    """A prefill of two prompts, then decode steps; each forward compiled and equal to eager."""
    rows = runner.req_to_token_pool.alloc(2)
    prompts = [[5, 17, 300, 41, 7], [100, 200, 300]]
    _compiled_equals_eager(
        runner, runner.build_forward_batch(ForwardMode.EXTEND, list(zip(rows, [0, 0], prompts)), capture_aux_hidden_layers=capture),
        capture,
    )
    lens, nxt = [len(p) for p in prompts], [3, 4]
    for _ in range(2):
        fb = runner.build_forward_batch(
            ForwardMode.DECODE, [(r, n, [t]) for r, n, t in zip(rows, lens, nxt)], capture_aux_hidden_layers=capture
        )
        nxt, lens = _compiled_equals_eager(runner, fb, capture).next_token_logits.argmax(-1).tolist(), [n + 1 for n in lens]
    runner.req_to_token_pool.free(rows)


@needs_cxx
def test_forwards_call_the_warm_up_graphs_without_dynamo(pair_dirs, rank0, monkeypatch):
    """After the warm-up, decode steps and prefills run the graphs' code directly (no guard check), each runner its
    own graphs: two runners of one process whose graphs differ (attention kernel or torch formulation; a DFLASH
    target's captures) share Dynamo's cache, alternate, and each stays equal to eager."""
    import sglite.srt.model_executor.compiled_decode_runner as cdr

    target, draft = pair_dirs
    with_kernel = ModelRunner(_args(target))
    destroy_parallel_runtime()  # the next runner initialises its own (TP 1: its forwards need no group)
    monkeypatch.setattr(cdr, "attention_kernel_serves", lambda model, dtype: False)
    without_kernel = ModelRunner(_args(target))
    destroy_parallel_runtime()
    dflash = ModelRunner(_args(target, speculative_algorithm="DFLASH", speculative_draft_model_path=draft))
    capture = [int(i) for i in dflash.spec_aux_config.target_layer_ids]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for runner in (with_kernel, without_kernel, dflash):
        assert runner.compiled_decode.calls_graphs_directly
        monkeypatch.setattr(runner.compiled_decode, "_compiled", _no_dynamo)
    assert with_kernel.compiled_decode.attention.use_kernel and not without_kernel.compiled_decode.attention.use_kernel
    for _ in range(2):
        _forwards_equal_eager(with_kernel)
        _forwards_equal_eager(without_kernel)
        _forwards_equal_eager(dflash, capture)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@needs_cxx
@pytest.mark.parametrize("hook", ["missing", "unreadable"])
def test_without_dynamo_cache_entries_forwards_go_through_the_guards(pair_dirs, rank0, monkeypatch, caplog, hook):
    """A torch build without the cache-entry hook, or whose entries look otherwise: a warning at start-up, and every
    forward through Dynamo."""
    if hook == "missing":
        monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    else:
        monkeypatch.setattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", lambda code: [object()])
    with caplog.at_level("WARNING", logger="sglite.srt.model_executor.compiled_decode_runner"):
        runner = ModelRunner(_args(pair_dirs[0]))
    assert not runner.compiled_decode.calls_graphs_directly
    assert "go through Dynamo's guard check" in caplog.text
    assert ("not readable" in caplog.text) == (hook == "unreadable")
    _forwards_equal_eager(runner)


def test_unsupported_configurations_are_errors_naming_the_flag():
    def runner(**kw):
        base = dict(
            device=torch.device("cpu"), parallel=SimpleNamespace(tp_size=1, attn_dp_size=1),
            model=SimpleNamespace(), token_to_kv_pool=SimpleNamespace(store_dtype=torch.float32, k_buffer=[]),
            dtype=torch.float32, kv_cache_dtype=torch.float32,
        )
        base.update(kw)
        return SimpleNamespace(**base)

    with pytest.raises(CompiledDecodeError, match="--enable-torch-compile does not support model SimpleNamespace"):
        check_compiled_decode_supported(runner())
    with pytest.raises(CompiledDecodeError, match="TP 1 only"):
        check_compiled_decode_supported(runner(parallel=SimpleNamespace(tp_size=2, attn_dp_size=1)))
    with pytest.raises(CompiledDecodeError, match="KV cache dtype"):
        check_compiled_decode_supported(runner(token_to_kv_pool=SimpleNamespace(store_dtype=torch.uint8, k_buffer=[])))
    for flags, msg in (
        (dict(device="cuda"), "CPU only"),
        (dict(tp_size=2), "--tp-size 1"),
        (dict(kv_cache_dtype="fp8_e4m3"), "fp8 --kv-cache-dtype"),
        (dict(torch_compile_max_bs=1), "--torch-compile-max-bs must be >= 2"),
    ):
        with pytest.raises(ServerArgsError, match=msg):
            ServerArgs(model_path="x", enable_torch_compile=True, **flags).validate()
