"""CPU fp32 GEMM for small batches on MKL-packed weights (linear layers and LM heads of target and draft).

At decode batch sizes (M = 2..64 rows) MKL's ``sgemm`` spends much of each call re-blocking the weight
into its micro-kernel layout; ``cblas_sgemm_pack`` does that once (torch exposes it as
``mkl::_mkl_reorder_linear_weight`` / ``mkl::_mkl_linear``, the ops Inductor's CPU freezing uses). On
this project's AVX2 box, over the 200 M Llama's GEMM shapes at 1 thread: M = 8 23.3 -> 16.1 ms, M = 32
38.0 -> 28.2 ms; but M = 1 (a gemv, bandwidth-bound) 11.3 -> 13.4 ms and prefill-sized M = 1024 670 ->
1012 ms got slower (docs/benchmarks.md, "Where the time goes"). So the packed copy is used only for
``PACKED_MIN_ROWS <= M <= PACKED_MAX_ROWS`` and the column-major weight (layers/utils.new_weight_matrix)
stays for the rest: the price is a second copy of the weights in memory (vLLM's CPU build packs with
oneDNN and drops the original, paying at M = 1 and at prefill instead). The pack is M-independent
(checked against ``F.linear`` at M = 1..1000), so one pack serves every batch; ``_mkl_linear`` takes it
when its ``prepack_batch_size`` equals M.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# The M the pack is tuned for: a decode batch. Any M is computed correctly with it.
_PACK_BATCH_HINT = 32
# Rows (tokens) for which the packed copy beats MKL's sgemm on the column-major weight (measured above).
PACKED_MIN_ROWS = 2
PACKED_MAX_ROWS = 64


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed sgemm (x86 CPU builds do)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + b``: through the packed copy for decode-sized batches when the layer has one, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        # One opaque op: Inductor cannot lower ``_mkl_linear`` on a packed weight it did not make
        # itself, and the row-count choice stays at run time (no shape guard, one graph for all M).
        return torch.ops.sglite.packed_linear(x, packed, weight, bias)
    return _linear_with_pack(x, packed, weight, bias)


def _linear_with_pack(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """The packed copy for ``PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS``, ``F.linear`` on the weight otherwise."""
    rows = x.numel() // x.shape[-1]
    if PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS:
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
    return F.linear(x, weight, bias)


# ``sglite::packed_linear``: ``_linear_with_pack`` as a registered op, for compiled forwards
# (model_executor/compiled_decode_runner.py). A plain Library registration: torch.library.custom_op's
# Python wrapper costs ~50 us a call, ~120 calls a step.
_LIB = torch.library.Library("sglite", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor packed, Tensor weight, Tensor? bias) -> Tensor")


def _packed_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_LIB.impl("packed_linear", _linear_with_pack, "CompositeExplicitAutograd")  # the pack is an MkldnnCPU tensor
torch.library.register_fake("sglite::packed_linear", _packed_linear_fake, lib=_LIB)


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        getattr(module, "packed_weight", False) is None  # the layer opted in (see _init_packed_slot)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
    )


def pack_weights_for_cpu(model: nn.Module) -> int:
    """Give every opted-in fp32 CPU weight of ``model`` a packed copy; returns how many were packed.

    A tied LM head gets its own packed copy too (the embedding keeps reading the original).
    """
    if not mkl_packing_available():
        return 0
    n = 0
    for module in model.modules():
        if _packable(module):
            w = module.weight.detach().contiguous()
            module.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(w, _PACK_BATCH_HINT)
            n += 1
    return n
