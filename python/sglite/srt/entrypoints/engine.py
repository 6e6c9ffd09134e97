"""The offline ``sglite.Engine`` (the server's processes without HTTP) and the /get_server_info payload.

The processes are started and watched by ``entrypoints/launcher.launch_subprocesses``.
"""

from __future__ import annotations

import asyncio
import atexit
from typing import Any, AsyncIterator, Iterator, Optional, Union

from sglite.srt.default_model import resolve_default_model
from sglite.srt.entrypoints.launcher import LaunchedRuntime, LaunchError, SchedulerEntry, launch_subprocesses
from sglite.srt.managers.io_struct import GenerateReqInput
from sglite.srt.managers.tokenizer_manager import scheduler_info_dict
from sglite.srt.server_args import ServerArgs
from sglite.version import __version__

__all__ = ["Engine", "LaunchError", "server_info"]


def server_info(runtime: LaunchedRuntime, internal_state: dict[str, Any]) -> dict[str, Any]:
    """The /get_server_info payload: server args, the scheduler's plan, live internal states."""
    return {
        **runtime.server_args.to_dict(),
        # The context length the server enforces (the flag, else the model's), not the flag's None.
        "context_length": runtime.scheduler_info.context_len,
        "version": __version__,
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

