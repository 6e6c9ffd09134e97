"""cpu_gemm: packed CPU weights (oneDNN or MKL) give F.linear's products at every batch size; the probe picks one."""

import dataclasses

import pytest
import torch
from torch import nn

from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers import cpu_gemm
from sglite.srt.layers.cpu_gemm import (
    PACKED_MAX_ROWS,
    available_pack_layouts,
    choose_pack_layout,
    linear,
    pack_weights_for_cpu,
)
from sglite.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglite.testing.fp32_reference import assert_same_dot_products

SUITE = "unit-cpu"
EST_TIME = 2

pytestmark = pytest.mark.skipif(not available_pack_layouts(), reason="torch built without MKL or oneDNN")


def rows_of_calls_to(monkeypatch, name: str) -> list[int]:
    """The row count of every call cpu_gemm makes to its function ``name`` from now on (the call still runs)."""
    calls, real = [], getattr(cpu_gemm, name)

    def spy(x, *args):
        calls.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(cpu_gemm, name, spy)
    return calls


def tp1() -> GroupCoordinator:
    return GroupCoordinator([0], 0, "tp", device_group=None)


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = tp1()
        self.qkv = ColumnParallelLinear(48, 80, bias=True, tp_group=g)
        self.o = RowParallelLinear(80, 48, bias=False, tp_group=g)
        self.rep = ReplicatedLinear(48, 24, bias=True)
        self.embed = VocabParallelEmbedding(100, 48, tp_group=g)
        self.head = ParallelLMHead(100, 48, tp_group=g)
        self.plain = nn.Linear(48, 8)  # not opted in: stays as it is


@pytest.mark.parametrize("layout", ["onednn", "mkl"])
def test_packed_layers_match_f_linear_at_every_batch_size(layout):
    if layout not in available_pack_layouts():
        pytest.skip(f"torch built without {layout}")
    torch.manual_seed(0)
    m = Holder()
    for p in m.parameters():
        p.data.copy_(torch.randn_like(p))
    m.head.tie_to(m.embed)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert pack_weights_for_cpu(m, layout).layout == layout
    packed = [mod for mod in m.modules() if mod.__dict__.get("packed_weight") is not None]
    assert {id(mod) for mod in packed} == {id(m.qkv), id(m.o), id(m.rep), id(m.head)}  # the tied head too
    assert m.plain.__dict__.get("packed_weight") is None and m.embed.__dict__.get("packed_weight") is None
    for k, v in m.state_dict().items():  # originals untouched: the embedding still reads the tied weight
        assert torch.equal(v, before[k]), k
    for rows in (1, 2, 7, 32, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 48)
        assert_same_dot_products(m.qkv(x), x, m.qkv.weight, m.qkv.bias)
        assert_same_dot_products(m.rep(x), x, m.rep.weight, m.rep.bias)
        assert_same_dot_products(linear(x, m.head.weight, None, m.head.packed_weight), x, m.embed.weight)
        h = torch.randn(2, rows, 80)  # 3-D input: rows are counted over the leading dims
        assert_same_dot_products(m.o(h), h, m.o.weight)


def test_fp16_cpu_weights_are_not_packed():
    m = ReplicatedLinear(16, 16, bias=False, params_dtype=torch.float16)
    assert pack_weights_for_cpu(m) is None and m.packed_weight is None


@pytest.mark.skipif(not available_pack_layouts(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_bf16_weights_take_the_onednn_pack_from_one_row_and_match_f_linear(monkeypatch):
    """bf16: oneDNN's pack only, serving one row too; the small-M and GGUF kernels (fp32) never see these weights."""
    torch.manual_seed(0)
    m = ReplicatedLinear(48, 80, bias=True, params_dtype=torch.bfloat16)
    for p in m.parameters():
        p.data.copy_(torch.randn_like(p))
    assert available_pack_layouts(torch.bfloat16) == ("onednn",)
    with pytest.raises(ValueError, match="'mkl'"):
        pack_weights_for_cpu(m, "mkl")
    choice = pack_weights_for_cpu(m)
    assert choice.layout == "onednn" and choice.small_m_rows[cpu_gemm.orientation(m.weight)] == 0
    assert m.packed_weight.tensor.dtype == torch.bfloat16 and m.packed_weight.small_m_rows == 0
    packed_rows = rows_of_calls_to(monkeypatch, "_pack_linear")
    small_m_rows = rows_of_calls_to(monkeypatch, "small_m_linear")
    all_rows = (1, 2, 7, 32, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1)
    for rows in all_rows:
        x = torch.randn(rows, 48, dtype=torch.bfloat16)
        y = m(x)
        assert y.dtype == torch.bfloat16
        # oneDNN accumulates in fp32 and rounds once: within one bf16 rounding of the fp32 product of the same inputs
        ref = torch.nn.functional.linear(x.float(), m.weight.float(), m.bias.float())
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
    assert packed_rows == [r for r in all_rows if r <= PACKED_MAX_ROWS] and small_m_rows == []


def test_the_fp32_kernels_serve_fp32_cpu_weights_only():
    cpu = torch.device("cpu")
    assert cpu_gemm.fp32_kernels_serve(cpu, torch.float32)
    assert not cpu_gemm.fp32_kernels_serve(cpu, torch.bfloat16)
    assert not cpu_gemm.fp32_kernels_serve(torch.device("cuda"), torch.float32)
    assert cpu_gemm.packed_min_rows(torch.float32) == cpu_gemm.PACKED_MIN_ROWS == 2
    assert cpu_gemm.packed_min_rows(torch.bfloat16) == 1


def test_a_model_packs_in_one_dtype_and_a_draft_only_in_a_layout_that_packs_it():
    fp32, bf16 = ReplicatedLinear(16, 16, bias=False), ReplicatedLinear(16, 16, bias=False, params_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        pack_weights_for_cpu(nn.ModuleList([fp32, bf16]))
    if "mkl" in available_pack_layouts() and available_pack_layouts(torch.bfloat16):
        with pytest.raises(ValueError, match="'mkl'.*does not pack"):
            pack_weights_for_cpu(bf16, like=cpu_gemm.PackChoice(layout="mkl"))


def test_a_test_sized_model_takes_the_default_layout_without_timing():
    """Under PROBE_MIN_BYTES the probe would time cache hits: the default, the same on every run."""
    choice = pack_weights_for_cpu(Holder())
    assert choice.layout == cpu_gemm.DEFAULT_PACK_LAYOUT and choice.probe_ms == {} and choice.probe_bytes == 0


def test_the_probe_times_every_layout_on_a_prefix_and_keeps_the_fastest(monkeypatch):
    layouts = available_pack_layouts()
    if len(layouts) < 2:
        pytest.skip("one pack layout only")
    monkeypatch.setattr(cpu_gemm, "PROBE_MIN_BYTES", 2 * 64 * 48 * 4)  # two of the three weights
    monkeypatch.setattr(cpu_gemm, "PROBE_ROWS", (4,))
    weights = [torch.randn(64, 48) for _ in range(3)]
    choice = choose_pack_layout(weights, layouts)
    assert set(choice.probe_ms) == set(layouts) and all(ms >= 0 for ms in choice.probe_ms.values())
    assert choice.layout == min(choice.probe_ms, key=choice.probe_ms.get)
    assert choice.probe_bytes == 2 * 64 * 48 * 4


def test_an_unknown_layout_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'avx9'"):
        pack_weights_for_cpu(Holder(), "avx9")


def test_probe_timings_give_the_kernels_row_counts():
    """Each count takes the verdict of the first probed count at or above it; a tie goes to the other route."""
    mask = cpu_gemm.small_m_rows_where_faster(
        {1: (2.0, 1.0), 2: (1.0, 2.0), 4: (3.0, 2.0), 8: (1.0, 2.0), 12: (2.0, 2.0), 16: (1.0, 1.5)}
    )
    assert [r for r in range(20) if mask >> r & 1] == [2, 5, 6, 7, 8, 13, 14, 15, 16]
    assert cpu_gemm.small_m_rows_where_faster({1: (2.0, 1.0), 2: (2.0, 1.0), 16: (2.0, 1.0)}) == 0
    mask = cpu_gemm.small_m_rows_where_faster({1: (1.0, 2.0), 2: (2.0, 1.0)})  # a gemv the kernel streams faster
    assert [r for r in range(20) if mask >> r & 1] == [1]


def test_a_packed_weight_takes_the_kernel_only_at_its_row_counts(monkeypatch):
    calls = rows_of_calls_to(monkeypatch, "small_m_linear")
    m = ReplicatedLinear(32, 64, bias=True)
    for p in m.parameters():
        p.data.copy_(torch.randn_like(p))
    pack_weights_for_cpu(m)
    m.packed_weight = cpu_gemm.PackedWeight(m.packed_weight.tensor, small_m_rows=1 << 1 | 1 << 4 | 1 << 9)
    for rows in range(1, 18):
        x = torch.randn(rows, 32)
        assert_same_dot_products(m(x), x, m.weight, m.bias)
    assert calls == [1, 4, 9]  # a gemv too, where its bit is set


def test_prefill_probe_timings_give_the_packs_row_limit():
    """The pack serves up to the last of an unbroken run of probed wins from the smallest count; a tie is a loss."""
    where = cpu_gemm.packed_max_rows_where_faster
    assert where({256: (1.0, 2.0), 1024: (1.0, 2.0)}) == cpu_gemm.UNBOUNDED_ROWS
    assert where({256: (1.0, 2.0), 1024: (3.0, 2.0)}) == 256
    assert where({256: (2.0, 1.0), 1024: (1.0, 2.0)}) == PACKED_MAX_ROWS
    assert where({256: (2.0, 2.0)}) == PACKED_MAX_ROWS and where({}) == PACKED_MAX_ROWS


def test_a_packed_weight_takes_the_pack_up_to_its_row_limit(monkeypatch):
    calls = rows_of_calls_to(monkeypatch, "_pack_linear")
    m = ReplicatedLinear(32, 64, bias=True)
    for p in m.parameters():
        p.data.copy_(torch.randn_like(p))
    pack_weights_for_cpu(m)
    m.packed_weight = cpu_gemm.PackedWeight(m.packed_weight.tensor, small_m_rows=0, max_rows=100)
    for rows in (1, 2, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 100, 101, 300):
        x = torch.randn(rows, 32)
        assert_same_dot_products(m(x), x, m.weight, m.bias)
    assert calls == [2, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 100]


def test_the_probe_times_the_kernel_per_orientation_and_a_draft_takes_the_targets_row_counts(monkeypatch):
    if cpu_gemm.small_m_kernel() is None:
        pytest.skip("the small-M kernel is not built here")
    monkeypatch.setattr(cpu_gemm, "PROBE_MIN_BYTES", 1)  # time the test model's weights (cache hits, any verdict)
    monkeypatch.setattr(cpu_gemm, "PROBE_REPEATS", 1)
    target = Holder()
    target.head.tie_to(target.embed)
    choice = pack_weights_for_cpu(target)
    assert set(choice.small_m_probe_ms) == set(cpu_gemm.ORIENTATIONS)  # the layers and the tied head's embedding
    for side, timed in choice.small_m_probe_ms.items():
        assert sorted(timed) == list(cpu_gemm.SMALL_M_PROBE_ROWS)
        assert choice.small_m_rows[side] == cpu_gemm.small_m_rows_where_faster(timed)
    assert target.qkv.packed_weight.small_m_rows == choice.small_m_rows["column-major"]
    assert target.head.packed_weight.small_m_rows == choice.small_m_rows["row-major"]
    assert set(choice.prefill_probe_ms) == set(cpu_gemm.ORIENTATIONS)  # and the pack's limit past decode batches
    for side, timed in choice.prefill_probe_ms.items():
        assert sorted(timed) == list(cpu_gemm.PREFILL_PROBE_ROWS)
        assert choice.packed_max_rows[side] == cpu_gemm.packed_max_rows_where_faster(timed)
    assert target.qkv.packed_weight.max_rows == choice.packed_max_rows["column-major"]
    assert target.head.packed_weight.max_rows == choice.packed_max_rows["row-major"]
    like = dataclasses.replace(
        choice, small_m_rows={"column-major": 1 << 3, "row-major": 1 << 5},
        packed_max_rows={"column-major": 256, "row-major": 1024},
    )
    draft = Holder()
    assert pack_weights_for_cpu(draft, like=like) is like
    assert draft.qkv.packed_weight.small_m_rows == 1 << 3 and draft.rep.packed_weight.small_m_rows == 1 << 3
    assert draft.qkv.packed_weight.max_rows == 256


def test_untimed_weights_take_every_kernel_row_count_and_the_default_pack_limit_and_no_kernel_takes_none(monkeypatch):
    m = Holder()
    choice = pack_weights_for_cpu(m)  # test-sized: untimed
    assert choice.small_m_probe_ms == {} and set(choice.small_m_rows.values()) == {cpu_gemm.ALL_SMALL_M_ROWS}
    assert [r for r in range(20) if cpu_gemm.ALL_SMALL_M_ROWS >> r & 1] == list(range(2, 17))  # a gemv: F.linear
    assert m.qkv.packed_weight.small_m_rows == cpu_gemm.ALL_SMALL_M_ROWS
    assert choice.prefill_probe_ms == {} and set(choice.packed_max_rows.values()) == {PACKED_MAX_ROWS}
    assert m.qkv.packed_weight.max_rows == PACKED_MAX_ROWS
    monkeypatch.setattr(cpu_gemm, "small_m_kernel", lambda: None)
    assert cpu_gemm.choose_small_m_rows([m.qkv.weight], [m.qkv.packed_weight.tensor]) == (0, {})


def _with_gguf_blocks(module: nn.Module, type_name: str = "Q8_0") -> None:
    """Give ``module`` a weight quantized by the gguf package, its blocks attached as the GGUF loader does (and a
    random bias: the layer allocates its parameters uninitialized, and leftover memory may hold NaN)."""
    import gguf

    from sglite.srt.layers.cpu_gguf_linear import GGUF_LINEAR_TYPES, gguf_weight_from_rows

    qtype = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(torch.randn_like(module.weight).contiguous().numpy(), qtype)
    module.weight.data.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    type_id = next(t for t, (name, _) in GGUF_LINEAR_TYPES.items() if name == type_name)
    module.gguf_weight = gguf_weight_from_rows(torch.from_numpy(blocks.copy()), type_id, module.weight.shape[1])
    if getattr(module, "bias", None) is not None:
        module.bias.data.copy_(torch.randn_like(module.bias))


def test_gguf_blocks_serve_only_their_row_counts_and_the_rest_take_the_fp32_route(monkeypatch):
    if not cpu_gemm.gguf_kernel_available():
        pytest.skip("the GGUF kernel is not built here")
    calls = rows_of_calls_to(monkeypatch, "gguf_linear")
    m = ReplicatedLinear(64, 48, bias=True)
    _with_gguf_blocks(m)
    pack_weights_for_cpu(m)  # test-sized: the blocks serve every count they cover
    assert m.packed_weight.gguf is m.gguf_weight and m.packed_weight.gguf_rows == cpu_gemm.ALL_GGUF_ROWS
    m.packed_weight = dataclasses.replace(m.packed_weight, gguf_rows=1 << 1 | 1 << 5)
    for rows in (1, 2, 5, 16, 17, 100):
        x = torch.randn(rows, 64)
        assert_same_dot_products(m(x), x, m.weight, m.bias)
    assert calls == [1, 5]


def test_the_gguf_probe_times_its_row_counts_against_the_fp32_route(monkeypatch):
    if not cpu_gemm.gguf_kernel_available():
        pytest.skip("the GGUF kernel is not built here")
    m = nn.Module()
    m.qkv, m.o, m.rep = ReplicatedLinear(64, 96, bias=False), ReplicatedLinear(96, 64, bias=False), ReplicatedLinear(64, 8)
    _with_gguf_blocks(m.qkv, "Q4_1")
    _with_gguf_blocks(m.o, "Q8_0")
    monkeypatch.setattr(cpu_gemm, "GGUF_PROBE_MIN_BYTES", 1)  # time the test model's blocks (any verdict)
    choice = pack_weights_for_cpu(m)
    assert sorted(choice.gguf_probe_ms) == list(cpu_gemm.GGUF_PROBE_ROWS)
    assert choice.gguf_rows == cpu_gemm.small_m_rows_where_faster(choice.gguf_probe_ms, low=1)
    assert m.qkv.packed_weight.gguf_rows == choice.gguf_rows and m.rep.packed_weight.gguf is None
    assert m.rep.packed_weight.gguf_rows == 0
    monkeypatch.setattr(cpu_gemm, "gguf_kernel_available", lambda: False)
    assert cpu_gemm.choose_gguf_rows([m.qkv], [m.qkv.packed_weight.tensor], choice) == (0, {})


def test_compiled_linears_keep_the_gguf_route():
    """The registered op takes the blocks and their row counts, so a compiled step reads the blocks too."""
    if not cpu_gemm.gguf_kernel_available():
        pytest.skip("the GGUF kernel is not built here")
    m = ReplicatedLinear(64, 48, bias=False)
    _with_gguf_blocks(m, "Q4_1")
    pack_weights_for_cpu(m)
    x = torch.randn(3, 64)
    p = m.packed_weight
    got = torch.ops.sglite.packed_linear(
        x, p.tensor, m.weight, None, p.small_m_rows, p.max_rows, p.gguf.blocks, p.gguf.ggml_type, p.gguf_rows
    )
    assert torch.equal(got, cpu_gemm.gguf_linear(x, p.gguf.blocks, p.gguf.ggml_type, None))
