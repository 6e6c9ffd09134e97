"""Process entry of one scheduler rank: build the model worker, the Scheduler and its PD component,
report ``SchedulerReady`` (or ``SchedulerInitError``) to the launcher, then serve forever."""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from sglite.srt.managers.base_model_worker import BaseModelWorker
from sglite.srt.managers.scheduler import Scheduler
from sglite.srt.server_args import ServerArgs
from sglite.srt.speculative.spec_info import SpeculativeAlgorithm

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor


def resolve_eos_token_ids(model_path: Optional[str], model_config: Any, tokenizer: Any) -> list[int]:
    """EOS ids as SGLang gathers them: config.json, generation_config.json, and the tokenizer's eos."""
    ids: list[int] = list(getattr(model_config, "eos_token_id", None) or [])
    gen_path = os.path.join(model_path, "generation_config.json") if model_path else None
    if gen_path and os.path.exists(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(tok_eos, int):
        ids.append(tok_eos)
    return sorted(set(int(i) for i in ids))


def create_model_worker(
    server_args: ServerArgs,
    *,
    rank: int = 0,
    world_size: int = 1,
    dist_init_method: Optional[str] = None,
    dp_rank: int = 0,
) -> BaseModelWorker:
    """The worker for --speculative-algorithm: DFlashWorker for DFLASH/DSPARK, else TpModelWorker."""
    algo = server_args.speculative_algorithm
    if SpeculativeAlgorithm.from_string(algo).is_dflash_family():
        from sglite.srt.speculative.dflash_worker import create_dflash_worker

        return create_dflash_worker(
            server_args, rank=rank, world_size=world_size, dist_init_method=dist_init_method, dp_rank=dp_rank
        )
    if algo is not None:
        raise ValueError(f"--speculative-algorithm {algo} is not served by sglite's scheduler; use DFLASH or DSPARK")
    from sglite.srt.managers.tp_worker import TpModelWorker

    return TpModelWorker.create(
        server_args, rank=rank, world_size=world_size, dist_init_method=dist_init_method, dp_rank=dp_rank
    )


def submit_tokenizer_load(pool: ThreadPoolExecutor, tokenizer_path: str) -> Future:
    """Start loading the tokenizer on ``pool``, once transformers' auto modules are imported in this thread.

    The model load in this thread imports them too (a GGUF's config goes through ``CONFIG_MAPPING``), and a first
    import of transformers' circular modules from two threads at once can hand one thread a half-initialised module:
    a cold ``sglite serve`` failed once in seven starts with "cannot import name 'CONFIG_MAPPING' from
    'transformers'". Imported here first (~1 s), only the tokenizer's file reading overlaps the weight load.
    """
    import transformers.models.auto.configuration_auto  # noqa: F401
    import transformers.models.auto.tokenization_auto  # noqa: F401

    from sglite.srt.managers.detokenizer_manager import load_tokenizer

    return pool.submit(load_tokenizer, tokenizer_path)


def run_scheduler_process(server_args: ServerArgs, port_args: Any, rank: int, world_size: int, pipe_writer: Any) -> None:
    """Process entry of one scheduler rank: build the worker, report ready on the pipe, serve forever.

    Rank 0 pulls requests from the TokenizerManager and pushes outputs to the detokenizer; with TP the
    other ranks receive rank 0's messages by broadcast and run the same schedule in lockstep.
    """
    import traceback
    from concurrent.futures import ThreadPoolExecutor

    import zmq

    from sglite.srt.disaggregation.factory import create_disagg
    from sglite.srt.managers.cpu_threads import apply_scheduler_threads
    from sglite.srt.managers.io_struct import SchedulerInitError, SchedulerReady
    from sglite.srt.managers.subprocess_watchdog import watch_parent

    watch_parent()
    logging.basicConfig(
        level=getattr(logging, str(server_args.log_level).upper(), logging.INFO),
        format=f"[scheduler {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if server_args.resolved_device() == "cpu":
            plan = apply_scheduler_threads(server_args, rank, world_size, port_args.dp_rank)
            logging.getLogger(__name__).info(
                "CPU compute threads: %d, %s", plan.num_threads,
                f"pinned to CPUs {','.join(map(str, plan.cpus))}" if plan.cpus is not None else "not pinned",
            )
        tokenizer_path = server_args.tokenizer_path or server_args.model_path
        with ThreadPoolExecutor(1, thread_name_prefix="sglite-tokenizer-load") as pool:
            # Reading the tokenizer files overlaps the weight load, whose numpy / torch kernels leave the GIL
            # free; transformers' modules are imported first, in this thread (submit_tokenizer_load says why).
            pending = submit_tokenizer_load(pool, tokenizer_path) if tokenizer_path else None
            worker = create_model_worker(
                server_args,
                rank=rank,
                world_size=world_size,
                dist_init_method=port_args.dist_init_method,
                dp_rank=port_args.dp_rank,
            )
            tokenizer = pending.result() if pending is not None else None
        runner = worker.target_runner
        eos = resolve_eos_token_ids(server_args.model_path, runner.model_config, tokenizer)
        scheduler = Scheduler(server_args, worker, tokenizer=tokenizer, eos_token_ids=eos)
        # PD: prefill hand-off or decode pre-allocation (the no-op component without PD).
        scheduler.disagg = create_disagg(scheduler, worker, server_args, rank, world_size)
        ready = SchedulerReady(
            max_total_num_tokens=int(worker.max_total_num_tokens),
            max_running_requests=scheduler.max_running_requests,
            context_len=scheduler.context_len,
            vocab_size=int(runner.model_config.vocab_size),
            memory_plan=worker.memory_plan(),
            rank_report=worker.rank_report() if worker.builds_pools else None,
            num_decode_tokens_per_req=int(worker.num_decode_tokens_per_req),
        )
    except BaseException as e:  # report start-up failures to the launcher, then exit non-zero
        pipe_writer.send(SchedulerInitError(message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()))
        raise
    recv_sock = send_sock = None
    # The front of this rank's DP group talks to the outside and broadcasts to the group. The group is
    # the attention-TP group: the TP group without DP attention, one attention-DP group with it.
    bcast_group = None
    is_front = rank == 0
    if world_size > 1:
        from sglite.srt.distributed.parallel_state import get_attn_tp_group

        bcast_group = get_attn_tp_group()
        is_front = bcast_group.is_first_rank
    if is_front:
        ctx = zmq.Context()
        recv_sock = ctx.socket(zmq.PULL)
        if port_args.fronts_connect:  # multi-node: node 0 binds every front's input
            recv_sock.connect(port_args.scheduler_input_ipc_name)
        else:
            recv_sock.bind(port_args.scheduler_input_ipc_name)
        send_sock = ctx.socket(zmq.PUSH)
        send_sock.connect(port_args.detokenizer_ipc_name)
    pipe_writer.send(ready)
    pipe_writer.close()
    scheduler.event_loop(recv_sock, send_sock, bcast_group)
