"""init_parallel_runtime(): join the world, build the groups, stamp live widths into the parallel bag.

Order (docs/parallelism.md): ``init_distributed_environment`` → ``initialize_model_parallel`` →
``initialize_dp_attention``. Each step stamps the live fields it owns, so a width read before its
step has run raises ``ParallelNotInitializedError`` naming that step. After the groups exist, the
widths they were built with are checked against ``derive_attention_widths``: a mismatch is a
start-up error, because the memory plan priced the pools at the derived widths.
"""

from __future__ import annotations

from typing import Optional, Union

from sglite.srt import runtime_context
from sglite.srt.distributed import parallel_state as ps
from sglite.srt.runtime_context import AttentionWidths, ParallelState, publish
from sglite.srt.server_args import ServerArgs


def _state_from_args(args: ServerArgs) -> ParallelState:
    return ParallelState(
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        enable_dp_attention=args.enable_dp_attention,
        attn_cp_size=args.attn_cp_size,
        pp_size=args.pp_size,
        ep_size=args.ep_size,
    )


def _sizes(state: ParallelState) -> tuple[int, int, bool, int, int, int]:
    return (state.tp_size, state.dp_size, state.enable_dp_attention, state.attn_cp_size, state.pp_size, state.ep_size)


def _resolve_state(server_args_or_sizes: Union[ServerArgs, ParallelState]) -> ParallelState:
    """The bag to stamp: the given one, else the already-published one, else a new published one."""
    current: Optional[ParallelState] = runtime_context._CTX.parallel
    if isinstance(server_args_or_sizes, ParallelState):
        state = server_args_or_sizes
    elif isinstance(server_args_or_sizes, ServerArgs):
        state = current if current is not None else _state_from_args(server_args_or_sizes)
        wanted = _sizes(_state_from_args(server_args_or_sizes))
        if _sizes(state) != wanted:
            raise RuntimeError(
                f"the published parallel bag has sizes {_sizes(state)} but the server args ask for {wanted} "
                "(tp, dp, enable_dp_attention, attn_cp, pp)"
            )
    else:
        raise TypeError(
            f"init_parallel_runtime takes ServerArgs or ParallelState, got {type(server_args_or_sizes).__name__}"
        )
    if current is None:
        publish(parallel=state)
    elif current is not state:
        raise RuntimeError("a different parallel bag is already published in this process; stamp that one")
    return state


def _check_supported(state: ParallelState) -> AttentionWidths:
    if state.pp_size != 1:
        raise ValueError(f"--pp-size {state.pp_size} is not supported: sglite has no pipeline parallelism")
    return state.derived_widths()


def init_parallel_runtime(
    server_args_or_sizes: Union[ServerArgs, ParallelState],
    rank: int = 0,
    world_size: Optional[int] = None,
    dist_init_method: Optional[str] = None,
    backend: Optional[str] = None,
    *,
    device: Optional[str] = None,
    dp_rank: int = 0,
    timeout_s: Optional[float] = None,
    local_rank: Optional[int] = None,
) -> ParallelState:
    """Initialise this rank's parallel runtime and return the stamped parallel bag.

    ``world_size`` defaults to tp_size (the ranks of one TP world; with DP attention the attention-DP
    replicas live inside it). ``dp_rank`` is the replica index of a TP world when DP runs without DP
    attention. ``backend`` defaults to gloo on CPU and nccl on CUDA.
    """
    state = _resolve_state(server_args_or_sizes)
    widths = _check_supported(state)
    args = server_args_or_sizes if isinstance(server_args_or_sizes, ServerArgs) else None
    if world_size is None:
        world_size = state.tp_size
    if timeout_s is None:
        timeout_s = float(args.dist_timeout) if args is not None else 60.0
    if dist_init_method is None and args is not None and args.dist_init_addr:
        dist_init_method = f"tcp://{args.dist_init_addr}"
    if backend is None:
        if device is None:
            device = args.resolved_device() if args is not None else ("cuda" if _cuda_available() else "cpu")
        backend = ps.default_backend(device)
    if ps.model_parallel_is_initialized():
        raise RuntimeError(
            "the parallel runtime is already initialised in this process; a draft runner reuses the "
            "target's groups (read get_parallel()), it does not call init_parallel_runtime() again"
        )

    # Step 1: the world.
    ps.init_distributed_environment(world_size, rank, dist_init_method, backend, timeout_s, local_rank)
    state.stamp(world_size=world_size, rank=rank, backend=backend)

    # Step 2: TP, attention-TP and attention-CP groups.
    ps.initialize_model_parallel(
        state.tp_size, widths.attn_tp_size, widths.attn_cp_size, widths.attn_dp_size, timeout_s=timeout_s
    )
    tp_group, attn_tp_group, attn_cp_group = ps.get_tp_group(), ps.get_attn_tp_group(), ps.get_attn_cp_group()
    built = AttentionWidths(
        attn_tp_size=attn_tp_group.world_size,
        attn_dp_size=tp_group.world_size // (attn_tp_group.world_size * attn_cp_group.world_size),
        attn_cp_size=attn_cp_group.world_size,
    )
    if built != widths:
        raise RuntimeError(
            f"parallel groups were built with widths {built} but derive_attention_widths gives {widths}; "
            "the memory plan would price pools at the wrong width"
        )
    tp_rank = tp_group.rank_in_group
    layout = ps.rank_layout(tp_rank, widths.attn_tp_size, widths.attn_cp_size, widths.attn_dp_size)
    if (layout.attn_tp_rank, layout.attn_cp_rank) != (attn_tp_group.rank_in_group, attn_cp_group.rank_in_group):
        raise RuntimeError(f"rank {rank}: group membership {attn_tp_group}, {attn_cp_group} disagrees with layout {layout}")
    state.stamp(
        tp_rank=tp_rank,
        attn_tp_size=widths.attn_tp_size,
        attn_tp_rank=layout.attn_tp_rank,
        attn_cp_rank=layout.attn_cp_rank,
        tp_group=tp_group,
        attn_tp_group=attn_tp_group,
        attn_cp_group=attn_cp_group,
    )

    # Step 3: DP attention.
    initialize_dp_attention(state, layout, dp_rank)
    return state


def initialize_dp_attention(state: ParallelState, layout: "ps.RankLayout", dp_rank: int = 0) -> None:
    """Stamp attention-DP width and ranks (with DP attention the DP rank is the attention-DP rank)."""
    widths = state.derived_widths()
    if state.enable_dp_attention:
        dp_rank = layout.attn_dp_rank
    elif not 0 <= dp_rank < state.dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside --dp-size {state.dp_size}")
    state.stamp(attn_dp_size=widths.attn_dp_size, attn_dp_rank=layout.attn_dp_rank, dp_rank=dp_rank)


def simulate_rank(parallel_state: ParallelState, rank: int, dp_rank: int = 0) -> ParallelState:
    """Stamp one rank's widths and ranks with no process groups (groups stay unset); for planning."""
    widths = _check_supported(parallel_state)
    layout = ps.rank_layout(rank, widths.attn_tp_size, widths.attn_cp_size, widths.attn_dp_size)
    parallel_state.stamp(
        world_size=parallel_state.tp_size,
        rank=rank,
        backend="simulated",
        tp_rank=rank,
        attn_tp_size=widths.attn_tp_size,
        attn_tp_rank=layout.attn_tp_rank,
        attn_cp_rank=layout.attn_cp_rank,
    )
    initialize_dp_attention(parallel_state, layout, dp_rank)
    return parallel_state


def destroy_parallel_runtime() -> None:
    """Tear down groups and the default process group (tests; a server exits instead)."""
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
