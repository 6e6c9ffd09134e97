"""Process launcher and the offline ``sglite.Engine`` (the server's processes without HTTP).

``launch_subprocesses`` starts one scheduler process per TP rank and the detokenizer process
(spawned, each exiting with its parent), waits for every rank's ``SchedulerReady``, and builds the
``TokenizerManager`` in this process. The HTTP server and the Engine both sit on top of it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing as mp
import shutil
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, ContextManager, Iterator, Optional, Union

from sglite.srt.managers.data_parallel_controller import format_rank_report
from sglite.srt.managers.io_struct import (
    GenerateReqInput,
    PortArgs,
    SchedulerInitError,
    SchedulerReady,
)
from sglite.srt.managers.tokenizer_manager import TokenizerManager, scheduler_info_dict
from sglite.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

SchedulerEntry = Callable[..., None]


class LaunchError(RuntimeError):
    """A subprocess failed to start; the message says which and why."""


@dataclass
class LaunchedRuntime:
    """Everything the front end holds after start-up."""

    server_args: ServerArgs
    port_args: PortArgs
    tokenizer_manager: TokenizerManager
    scheduler_info: SchedulerReady  # rank 0's
    processes: list[tuple[str, Any]]  # (name, multiprocessing.Process)
    rank_infos: list[SchedulerReady]  # every rank's, in rank order (per-rank memory plans)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the subprocesses (terminate, then kill) and remove the ipc dir."""
        self.tokenizer_manager.close()
        for _, proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for _, proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)


def _default_scheduler_entry() -> SchedulerEntry:
    from sglite.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process


def launch_subprocesses(
    server_args: ServerArgs,
    *,
    scheduler_entry: Optional[SchedulerEntry] = None,
    startup_timeout_s: float = 600.0,
) -> LaunchedRuntime:
    """Start scheduler ranks + detokenizer, wait until ready, return the runtime (raises LaunchError)."""
    from sglite.srt.managers.detokenizer_manager import load_tokenizer

    entry = scheduler_entry or _default_scheduler_entry()
    if server_args.dp_size > 1:  # DP replicas or DP attention: a controller in front of the DP groups
        from sglite.srt.managers.data_parallel_controller import launch_dp_subprocesses

        return launch_dp_subprocesses(server_args, scheduler_entry=entry, startup_timeout_s=startup_timeout_s)
    port_args = PortArgs.create(server_args)
    ctx = mp.get_context("spawn")
    world_size = server_args.tp_size
    processes: list[tuple[str, Any]] = []
    readers = []
    with kill_on_failure(processes, port_args.ipc_dir):
        for rank in range(world_size):
            spawn_scheduler_rank(
                ctx, entry, (server_args, port_args, rank, world_size), f"sglite-scheduler-{rank}",
                f"scheduler rank {rank}", processes, readers,
            )
        detok = spawn_detokenizer(ctx, server_args, port_args, processes)
        tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
        infos = [_wait_ready(name, proc, reader, startup_timeout_s) for (name, proc), reader in zip(processes, readers)]
        if not detok.is_alive():
            raise LaunchError(f"the detokenizer process exited during start-up with code {detok.exitcode}")
    for info_r in infos:
        if info_r.rank_report is not None:
            logger.info("%s", format_rank_report(info_r.rank_report))
    info = infos[0]
    tm = TokenizerManager(server_args, port_args, tokenizer, info, child_processes=processes)
    return LaunchedRuntime(server_args, port_args, tm, info, processes, infos)


def spawn_scheduler_rank(
    ctx: Any, entry: SchedulerEntry, args: tuple, proc_name: str, label: str,
    processes: list[tuple[str, Any]], readers: list[Any],
    start_context: ContextManager[Any] = contextlib.nullcontext(),
) -> None:
    """Start one scheduler rank (entry(*args, ready_pipe)); record it as (label, proc) and its pipe's reader.

    ``start_context`` wraps ``proc.start()`` (the DP launcher pins the replica's visible devices there)."""
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=entry, args=(*args, writer), name=proc_name, daemon=True)
    with start_context:
        proc.start()
    writer.close()  # the child holds the only write end: EOF on the reader means it died
    processes.append((label, proc))
    readers.append(reader)


def spawn_detokenizer(ctx: Any, server_args: ServerArgs, port_args: PortArgs, processes: list[tuple[str, Any]]) -> Any:
    """Start the detokenizer process and record it as ("detokenizer", proc); returns the process."""
    from sglite.srt.managers.detokenizer_manager import run_detokenizer_process

    detok = ctx.Process(
        target=run_detokenizer_process, args=(server_args, port_args), name="sglite-detokenizer", daemon=True
    )
    detok.start()
    processes.append(("detokenizer", detok))
    return detok


def _wait_ready(name: str, proc: Any, reader: Any, timeout_s: float) -> SchedulerReady:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if reader.poll(0.5):
            try:
                msg = reader.recv()
            except EOFError:
                proc.join(2.0)
                raise LaunchError(f"{name} closed its pipe during start-up (exit code {proc.exitcode})") from None
            if isinstance(msg, SchedulerInitError):
                raise LaunchError(f"{name} failed to start: {msg.message}\n{msg.traceback}")
            if not isinstance(msg, SchedulerReady):
                raise LaunchError(f"{name} sent {type(msg).__name__} instead of SchedulerReady")
            return msg
        if not proc.is_alive():
            raise LaunchError(f"{name} exited during start-up with code {proc.exitcode} (see its log above)")
    raise LaunchError(f"{name} was not ready after {timeout_s:.0f} s")


@contextlib.contextmanager
def kill_on_failure(processes: list[tuple[str, Any]], ipc_dir: str) -> Iterator[None]:
    """On any failure inside (Ctrl-C included) kill the started processes and remove ipc_dir, then re-raise."""
    try:
        yield
    except BaseException:
        _kill_all(processes)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise


def _kill_all(processes: list[tuple[str, Any]]) -> None:
    for _, proc in processes:
        if proc.is_alive():
            proc.kill()
    for _, proc in processes:
        proc.join(2.0)


def server_info(runtime: LaunchedRuntime, internal_state: dict[str, Any]) -> dict[str, Any]:
    """The /get_server_info payload: server args, the scheduler's plan, live internal states."""
    import sglite

    return {
        **runtime.server_args.to_dict(),
        "version": sglite.__version__,
        "scheduler_info": scheduler_info_dict(runtime.scheduler_info),
        "memory_plan": runtime.scheduler_info.memory_plan,
        "memory_plan_per_rank": [info.memory_plan for info in runtime.rank_infos],
        "max_total_num_tokens": runtime.scheduler_info.max_total_num_tokens,
        # With DP the controller merges every group's state and lists each (with its dp_rank).
        "internal_states": internal_state.get("dp_internal_states") or [internal_state],
        "ranks": [info.rank_report for info in runtime.rank_infos],
        "process_pids": {name: proc.pid for name, proc in runtime.processes},
        "front_end": {
            "num_tracked_reqs": len(runtime.tokenizer_manager.rid_to_state),
            "num_finished": runtime.tokenizer_manager.num_finished,
            "num_aborted": runtime.tokenizer_manager.num_aborted,
        },
    }


class Engine:
    """Offline engine: ``Engine(model_path=..., **server_args)``, then generate / generate_stream."""

    def __init__(self, model_path: Optional[str] = None, *, scheduler_entry: Optional[SchedulerEntry] = None, **kwargs: Any) -> None:
        from sglite.launch_server import resolve_default_model

        server_args = resolve_default_model(ServerArgs(model_path=model_path, **kwargs)).validate()
        self.server_args = server_args
        self._loop = asyncio.new_event_loop()
        self._runtime: Optional[LaunchedRuntime] = launch_subprocesses(server_args, scheduler_entry=scheduler_entry)
        self.tokenizer_manager = self._runtime.tokenizer_manager
        self.tokenizer = self.tokenizer_manager.tokenizer
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ generation
    def _request(
        self,
        prompt: Optional[Union[str, list[str]]],
        sampling_params: Optional[Union[dict, list[dict]]],
        input_ids: Optional[Union[list[int], list[list[int]]]],
        stream: bool,
        **kwargs: Any,
    ) -> GenerateReqInput:
        return GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params, stream=stream, **kwargs)

    def generate(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        sampling_params: Optional[Union[dict, list[dict]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        **kwargs: Any,
    ) -> Union[dict[str, Any], list[dict[str, Any]]]:
        """Generate to completion: one dict ``{"text","output_ids","meta_info"}`` or a list for a batch."""
        obj = self._request(prompt, sampling_params, input_ids, False, **kwargs)
        is_batch = obj.is_batch

        async def run() -> list[dict[str, Any]]:
            outs = [o async for o in self.tokenizer_manager.generate_request(obj)]
            outs.sort(key=lambda o: o["index"])
            return [_public(o) for o in outs]

        results = self._run(run())
        return results if is_batch else results[0]

    def generate_stream(
        self,
        prompt: Optional[str] = None,
        sampling_params: Optional[dict] = None,
        input_ids: Optional[list[int]] = None,
        **kwargs: Any,
    ) -> Iterator[dict[str, Any]]:
        """Yield ``{"text" (delta), "output_ids" (delta), "meta_info"}`` as tokens arrive (one prompt)."""
        obj = self._request(prompt, sampling_params, input_ids, True, **kwargs)
        if obj.is_batch:
            raise ValueError("generate_stream takes one prompt; call it once per prompt")
        agen: AsyncIterator[dict[str, Any]] = self.tokenizer_manager.generate_request(obj).__aiter__()
        try:
            while True:
                try:
                    out = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield {"text": out["delta_text"], "output_ids": out["delta_output_ids"], "meta_info": out["meta_info"]}
        finally:
            # Closing early (break / garbage collection) aborts the request in the generator's finally.
            if self._runtime is not None:
                self._run(agen.aclose())

    def abort_request(self, rid: str) -> None:
        """Abort a request by id."""
        self.tokenizer_manager.abort_request(rid)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; True when the scheduler did it."""
        return self._run(self.tokenizer_manager.flush_cache()).success

    def get_server_info(self) -> dict[str, Any]:
        """Server args, the memory plan, and the scheduler's live state."""
        assert self._runtime is not None, "the engine is shut down"
        state = self._run(self.tokenizer_manager.get_internal_state())
        return server_info(self._runtime, state)

    def _run(self, coro: Any) -> Any:
        if self._runtime is None:
            raise RuntimeError("the engine is shut down")
        return self._loop.run_until_complete(coro)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop every subprocess (idempotent)."""
        if self._runtime is None:
            return
        runtime, self._runtime = self._runtime, None
        task = runtime.tokenizer_manager._handle_task
        if task is not None and not task.done():
            task.cancel()
            self._loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        runtime.shutdown()
        self._loop.close()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _public(out: dict[str, Any]) -> dict[str, Any]:
    return {"text": out["text"], "output_ids": out["output_ids"], "meta_info": out["meta_info"]}

