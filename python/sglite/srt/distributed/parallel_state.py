"""Process groups of one serving world: TP, attention-TP, attention-CP and attention-DP peers.

Rank layout inside a TP world of ``tp_size`` ranks is (attn_dp, attn_cp, attn_tp) with attn_tp
fastest: ``tp_rank = (attn_dp_rank * attn_cp + attn_cp_rank) * attn_tp + attn_tp_rank``.

A size-1 group never touches ``torch.distributed`` (every collective is the identity), so a
single-rank runtime needs no process group at all. Every rank creates every multi-rank group in
the same order, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch

from sglite.srt.runtime_context import ParallelNotInitializedError


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits in the (attn_dp, attn_cp, attn_tp) grid of a TP world."""

    tp_rank: int
    attn_dp_rank: int
    attn_cp_rank: int
    attn_tp_rank: int


def rank_layout(tp_rank: int, attn_tp_size: int, attn_cp_size: int, attn_dp_size: int) -> RankLayout:
    """Decompose a TP rank into (attn_dp, attn_cp, attn_tp) coordinates, attn_tp fastest."""
    tp_size = attn_tp_size * attn_cp_size * attn_dp_size
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside a TP world of {tp_size} ranks")
    attn_tp_rank = tp_rank % attn_tp_size
    attn_cp_rank = (tp_rank // attn_tp_size) % attn_cp_size
    attn_dp_rank = tp_rank // (attn_tp_size * attn_cp_size)
    return RankLayout(tp_rank, attn_dp_rank, attn_cp_rank, attn_tp_rank)


def attn_tp_group_ranks(attn_tp_size: int, attn_cp_size: int, attn_dp_size: int) -> list[list[int]]:
    """Members of every attention-TP group: consecutive blocks of attn_tp ranks."""
    n_blocks = attn_dp_size * attn_cp_size
    return [[b * attn_tp_size + t for t in range(attn_tp_size)] for b in range(n_blocks)]


def attn_dp_peer_group_ranks(attn_tp_size: int, attn_cp_size: int, attn_dp_size: int) -> list[list[int]]:
    """Members of every attention-DP peer group: same (cp, tp) coordinates in every attention-DP group.

    DP attention's token exchange all-gathers over these groups: each member holds its DP group's
    tokens (replicated over attn_tp), so gathering across peers yields every group's tokens once.
    """
    groups = []
    for c in range(attn_cp_size):
        for t in range(attn_tp_size):
            groups.append([(d * attn_cp_size + c) * attn_tp_size + t for d in range(attn_dp_size)])
    return groups


def attn_cp_group_ranks(attn_tp_size: int, attn_cp_size: int, attn_dp_size: int) -> list[list[int]]:
    """Members of every attention-CP group: same (dp, tp) coordinates, strided by attn_tp."""
    groups = []
    for d in range(attn_dp_size):
        for t in range(attn_tp_size):
            groups.append([(d * attn_cp_size + c) * attn_tp_size + t for c in range(attn_cp_size)])
    return groups


class GroupCoordinator:
    """One process group as seen from one rank: collectives that are no-ops when the group has one rank."""

    def __init__(
        self,
        ranks: list[int],
        global_rank: int,
        name: str,
        device_group: Any = None,
        cpu_group: Any = None,
    ) -> None:
        if global_rank not in ranks:
            raise ValueError(f"rank {global_rank} is not a member of group {name!r} {ranks}")
        if len(ranks) > 1 and device_group is None:
            raise ValueError(f"group {name!r} has {len(ranks)} ranks but no process group")
        self.name = name
        self.ranks = list(ranks)
        self.global_rank = global_rank
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(global_rank)
        self.device_group = device_group
        # Objects travel over a CPU (gloo) group: NCCL cannot pickle-broadcast without a device dance.
        self.cpu_group = cpu_group if cpu_group is not None else device_group

    @property
    def is_first_rank(self) -> bool:
        """Whether this rank is rank 0 of the group."""
        return self.rank_in_group == 0

    def _global(self, src: int) -> int:
        if not 0 <= src < self.world_size:
            raise ValueError(f"src {src} is outside group {self.name!r} of size {self.world_size}")
        return self.ranks[src]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns the tensor."""
        if self.world_size == 1:
            return tensor
        torch.distributed.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every member's tensor along ``dim``, in group-rank order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite every member's tensor with group-rank ``src``'s, in place; returns the tensor."""
        if self.world_size == 1:
            self._global(src)
            return tensor
        torch.distributed.broadcast(tensor, src=self._global(src), group=self.device_group)
        return tensor

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Send a picklable object from group-rank ``src`` to every member; returns it everywhere."""
        if self.world_size == 1:
            self._global(src)
            return obj
        box = [obj if self.rank_in_group == src else None]
        torch.distributed.broadcast_object_list(box, src=self._global(src), group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's picklable object, in group-rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def barrier(self) -> None:
        """Wait for every member."""
        if self.world_size == 1:
            return
        torch.distributed.barrier(group=self.cpu_group)

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.name!r}, ranks={self.ranks}, rank_in_group={self.rank_in_group})"


# ---------------------------------------------------------------------------- module state

_TP: Optional[GroupCoordinator] = None
_ATTN_TP: Optional[GroupCoordinator] = None
_ATTN_CP: Optional[GroupCoordinator] = None
_ATTN_DP_PEERS: Optional[GroupCoordinator] = None
_WORLD: Optional[dict[str, Any]] = None  # {"rank", "world_size", "backend", "owns_process_group"}


def _need(group: Optional[GroupCoordinator], name: str) -> GroupCoordinator:
    if group is None:
        raise ParallelNotInitializedError(
            f"the {name} group does not exist: initialize_model_parallel() has not run in this process "
            "(call init_parallel_runtime() first)"
        )
    return group


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group (all ranks of this TP world)."""
    return _need(_TP, "tensor-parallel")


def get_attn_tp_group() -> GroupCoordinator:
    """The attention tensor-parallel group of this rank."""
    return _need(_ATTN_TP, "attention-TP")


def get_attn_cp_group() -> GroupCoordinator:
    """The attention context-parallel group of this rank."""
    return _need(_ATTN_CP, "attention-CP")


def get_attn_dp_peer_group() -> GroupCoordinator:
    """This rank's peers in the other attention-DP groups (size attn_dp_size; 1 without DP attention)."""
    return _need(_ATTN_DP_PEERS, "attention-DP peer")


def model_parallel_is_initialized() -> bool:
    """Whether initialize_model_parallel() has run in this process."""
    return _TP is not None


def default_backend(device: str) -> str:
    """gloo on CPU, nccl on CUDA."""
    if device == "cuda":
        return "nccl"
    if device == "cpu":
        return "gloo"
    raise ValueError(f"no distributed backend for device {device!r}; use cpu or cuda")


def init_distributed_environment(
    world_size: int,
    rank: int,
    dist_init_method: Optional[str],
    backend: str,
    timeout_s: float = 60.0,
    local_rank: Optional[int] = None,
) -> None:
    """Join the default process group (skipped for a one-rank world, which needs none)."""
    global _WORLD
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    if _WORLD is not None:
        if (_WORLD["rank"], _WORLD["world_size"]) != (rank, world_size):
            raise RuntimeError(
                f"distributed environment already initialised as rank {_WORLD['rank']}/{_WORLD['world_size']}; "
                f"cannot re-initialise as {rank}/{world_size} (call destroy_parallel_runtime() first)"
            )
        return
    if backend == "nccl":
        n_dev = torch.cuda.device_count()
        if n_dev == 0:
            raise RuntimeError("backend nccl needs CUDA devices but none are visible; use --device cpu (gloo)")
        torch.cuda.set_device(rank % n_dev if local_rank is None else local_rank)
    owns = False
    if world_size > 1:
        if dist_init_method is None:
            raise ValueError(
                f"a world of {world_size} ranks needs a rendezvous address: set --dist-init-addr "
                "(or pass dist_init_method='tcp://host:port')"
            )
        if torch.distributed.is_initialized():
            if torch.distributed.get_world_size() != world_size or torch.distributed.get_rank() != rank:
                raise RuntimeError("torch.distributed is already initialised with a different rank/world size")
        else:
            torch.distributed.init_process_group(
                backend=backend,
                init_method=dist_init_method,
                world_size=world_size,
                rank=rank,
                timeout=timedelta(seconds=timeout_s),
            )
            owns = True
    _WORLD = {"rank": rank, "world_size": world_size, "backend": backend, "owns_process_group": owns}


def _make_groups(
    all_groups: list[list[int]], rank: int, name: str, world_size: int, backend: str, timeout_s: float
) -> GroupCoordinator:
    """Create every group of one kind on every rank (new_group is collective); keep this rank's."""
    mine: Optional[GroupCoordinator] = None
    for ranks in all_groups:
        device_group = cpu_group = None
        if len(ranks) > 1:
            if len(ranks) == world_size:
                device_group = torch.distributed.group.WORLD
            else:
                device_group = torch.distributed.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout_s))
            if backend != "gloo":
                cpu_group = torch.distributed.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        if rank in ranks:
            mine = GroupCoordinator(ranks, rank, name, device_group, cpu_group)
    if mine is None:
        raise RuntimeError(f"rank {rank} is in no {name} group of {all_groups}")
    return mine


def initialize_model_parallel(
    tp_size: int, attn_tp_size: int, attn_cp_size: int, attn_dp_size: int, timeout_s: float = 60.0
) -> None:
    """Build the TP, attention-TP, attention-CP and attention-DP peer groups of this TP world."""
    global _TP, _ATTN_TP, _ATTN_CP, _ATTN_DP_PEERS
    if _WORLD is None:
        raise ParallelNotInitializedError(
            "initialize_model_parallel() needs init_distributed_environment() to have run first"
        )
    if _TP is not None:
        raise RuntimeError("model parallel groups are already initialised (call destroy_parallel_runtime() first)")
    world_size, rank, backend = _WORLD["world_size"], _WORLD["rank"], _WORLD["backend"]
    if tp_size != world_size:
        raise ValueError(f"--tp-size {tp_size} must equal the number of ranks in this world ({world_size})")
    if attn_tp_size * attn_cp_size * attn_dp_size != tp_size:
        raise ValueError(
            f"attention widths tp {attn_tp_size} x cp {attn_cp_size} x dp {attn_dp_size} do not cover tp {tp_size}"
        )
    _TP = _make_groups([list(range(tp_size))], rank, "tp", world_size, backend, timeout_s)
    _ATTN_TP = _make_groups(
        attn_tp_group_ranks(attn_tp_size, attn_cp_size, attn_dp_size), rank, "attn_tp", world_size, backend, timeout_s
    )
    _ATTN_CP = _make_groups(
        attn_cp_group_ranks(attn_tp_size, attn_cp_size, attn_dp_size), rank, "attn_cp", world_size, backend, timeout_s
    )
    _ATTN_DP_PEERS = _make_groups(
        attn_dp_peer_group_ranks(attn_tp_size, attn_cp_size, attn_dp_size),
        rank, "attn_dp_peers", world_size, backend, timeout_s,
    )


def world_info() -> dict[str, Any]:
    """rank, world_size and backend of this process's distributed environment."""
    if _WORLD is None:
        raise ParallelNotInitializedError("init_distributed_environment() has not run in this process")
    return dict(_WORLD)


def destroy_model_parallel() -> None:
    """Forget the TP / attention groups (the process groups die with the default group)."""
    global _TP, _ATTN_TP, _ATTN_CP, _ATTN_DP_PEERS
    _TP = _ATTN_TP = _ATTN_CP = _ATTN_DP_PEERS = None


def destroy_distributed_environment() -> None:
    """Leave the default process group if this module created it."""
    global _WORLD
    if _WORLD is not None and _WORLD["owns_process_group"] and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _WORLD = None

