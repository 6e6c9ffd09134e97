"""PD disaggregation vocabulary: transfer states, registered KV buffers, slot-run coalescing.

A KV buffer is one contiguous tensor whose row i holds slot i (a per-layer K or V buffer of the
target pool or of the DFLASH draft pool). Moving a request's KV means copying rows src_slots[j]
of every prefill buffer to rows dst_slots[j] of the matching decode buffer; runs of consecutive
slots on both sides become one copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence


class KVPoll(enum.IntEnum):
    """Transfer state of one request (room); the order matters: MIN over ranks is the group state."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class SchedulerDisagg:
    """The scheduler's PD component. This base is the no-op of a server without --disaggregation-mode;
    PrefillHandoff and DecodePrealloc override what their role does, so the scheduler never checks for None."""

    def add(self, req: Any) -> bool:
        """Take a new request (a decode node pre-allocates for it); False: it goes to the waiting queue."""
        return False

    def hand_off(self, req: Any, first_token: int, first_token_logprob: Optional[float] = None) -> bool:
        """Take a request whose prompt is prefilled (a prefill node ships its KV); False: it decodes here."""
        return False

    def step(self) -> None:
        """Once per scheduler step: advance transfers (finish handed-off prefills, admit arrived KV)."""

    def has_work(self) -> bool:
        """Whether requests are held here (KV transfers in flight)."""
        return False

    def live_reqs(self) -> list[Any]:
        """Every request held here (for aborts and duplicate-id checks)."""
        return []

    def abort(self, req: Any, reason: dict) -> bool:
        """End a request held here, freeing what it holds; False if not held here."""
        return False

    def close(self) -> None:
        """Stop transfer threads and servers."""

    def state(self) -> dict[str, int]:
        """Counters for /get_server_info."""
        return {}


@dataclass(frozen=True)
class PDRank:
    """Where a scheduler rank sits among its node's KV holders.

    ``num_groups`` DP groups (attention-DP groups, or replicas) of ``group_width`` ranks (the attention-TP
    width) each; a request's KV lives on the ranks of one group. A prefill node serves a room in group
    ``room % num_groups`` (its controller's ``follow_bootstrap_room``), so a decode rank's peer for a room is
    prefill engine rank ``(room % num_groups) * group_width + rank_in_group``.
    """

    dp_rank: int
    rank_in_group: int
    group_width: int
    num_groups: int

    @property
    def engine_rank(self) -> int:
        """This rank's index over the node, unique across DP groups."""
        return self.dp_rank * self.group_width + self.rank_in_group


SINGLE_RANK = PDRank(dp_rank=0, rank_in_group=0, group_width=1, num_groups=1)


def prefill_peer_rank(room: int, rank_in_group: int, prefill_group_width: int, prefill_num_groups: int) -> int:
    """The prefill engine rank holding a room's KV for the decode rank at ``rank_in_group`` of its group."""
    if rank_in_group >= prefill_group_width:
        raise TransferError(
            f"decode rank {rank_in_group} of its attention group has no prefill peer: the prefill node's groups "
            f"are {prefill_group_width} wide; give both nodes the same attention-TP width (--tp-size / --dp-size)"
        )
    return (int(room) % prefill_num_groups) * prefill_group_width + rank_in_group


class TransferError(RuntimeError):
    """A KV transfer could not complete (peer gone, timeout, backend error)."""


@dataclass(frozen=True)
class KVBufferSpec:
    """One registered buffer: its address, size, and bytes per slot row."""

    name: str
    ptr: int
    nbytes: int
    item_bytes: int

    def to_wire(self) -> dict:
        """Plain dict for JSON / msgpack."""
        return {"name": self.name, "ptr": self.ptr, "nbytes": self.nbytes, "item_bytes": self.item_bytes}

    @classmethod
    def from_wire(cls, d: dict) -> "KVBufferSpec":
        """Inverse of to_wire."""
        return cls(d["name"], int(d["ptr"]), int(d["nbytes"]), int(d["item_bytes"]))


def buffer_specs_from_tensors(named_tensors: Iterable[tuple[str, "object"]]) -> list[KVBufferSpec]:
    """Describe contiguous tensors (row = slot) as transfer buffers."""
    specs = []
    for name, t in named_tensors:
        if not t.is_contiguous():
            raise ValueError(f"KV buffer {name} must be contiguous to be transferred")
        rows = t.shape[0]
        nbytes = t.numel() * t.element_size()
        specs.append(KVBufferSpec(name, t.data_ptr(), nbytes, nbytes // rows))
    return specs


def coalesce_slot_runs(src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group slot pairs into (src_start, dst_start, length) runs that are consecutive on both sides."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destination slots")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_slots, dst_slots):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((int(s), int(d), 1))
    return runs


def plan_copies(
    src_buffers: Sequence[KVBufferSpec],
    dst_buffers: Sequence[KVBufferSpec],
    src_slots: Sequence[int],
    dst_slots: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """(src_ptrs, dst_ptrs, lengths) for copying the slot rows of every buffer pair."""
    if [b.name for b in src_buffers] != [b.name for b in dst_buffers]:
        raise TransferError(
            "prefill and decode KV buffers differ: "
            f"{[b.name for b in src_buffers]} vs {[b.name for b in dst_buffers]} "
            "(both nodes must run the same model, draft, --tp-size and --kv-cache-dtype)"
        )
    runs = coalesce_slot_runs(src_slots, dst_slots)
    src_ptrs, dst_ptrs, lengths = [], [], []
    for sb, db in zip(src_buffers, dst_buffers):
        if sb.item_bytes != db.item_bytes:
            raise TransferError(f"buffer {sb.name}: {sb.item_bytes} B/slot on prefill, {db.item_bytes} on decode")
        for s, d, n in runs:
            if (s + n) * sb.item_bytes > sb.nbytes or (d + n) * db.item_bytes > db.nbytes:
                raise TransferError(f"buffer {sb.name}: slot run ({s}, {d}, {n}) is out of range")
            src_ptrs.append(sb.ptr + s * sb.item_bytes)
            dst_ptrs.append(db.ptr + d * db.item_bytes)
            lengths.append(n * sb.item_bytes)
    return src_ptrs, dst_ptrs, lengths
