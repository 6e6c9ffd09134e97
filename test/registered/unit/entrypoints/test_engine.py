"""Engine/launcher failure paths over the scheduler test double: start-up errors and a dying scheduler."""

import time

import pytest

from fake_scheduler import run_fake_scheduler
from sglite.srt.entrypoints.engine import Engine, LaunchError
from sglite.srt.managers.io_struct import SchedulerInitError
from sglite.srt.managers.tokenizer_manager import EngineDeadError

SUITE = "unit-cpu"
EST_TIME = 40

pytestmark = pytest.mark.timeout(180)


def failing_scheduler(server_args, port_args, rank, world_size, pipe_writer):
    """Reports a start-up failure the way run_scheduler_process does."""
    pipe_writer.send(SchedulerInitError(message="ValueError: the KV budget is too small", traceback="tb"))


def crashing_scheduler(server_args, port_args, rank, world_size, pipe_writer):
    """Dies before saying anything."""
    import os

    os._exit(7)


@pytest.mark.parametrize("entry, fragment", [(failing_scheduler, "KV budget is too small"), (crashing_scheduler, "code 7")])
def test_startup_failure_is_a_clear_error(tokenizer_dir, entry, fragment):
    with pytest.raises(LaunchError, match=fragment):
        Engine(model_path=tokenizer_dir, scheduler_entry=entry)


def test_dead_scheduler_raises_instead_of_hanging(tokenizer_dir):
    engine = Engine(model_path=tokenizer_dir, scheduler_entry=run_fake_scheduler)
    try:
        out = engine.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 3})
        assert out["meta_info"]["completion_tokens"] == 3
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="scheduler rank 0"):
            engine.generate(input_ids=[0, 1, 5], sampling_params={"max_new_tokens": 3})  # the double's die sentinel
        assert time.monotonic() - start < 15
        with pytest.raises(EngineDeadError):
            engine.generate(input_ids=[7, 8], sampling_params={"max_new_tokens": 3})
    finally:
        engine.shutdown()


def test_shutdown_stops_every_process(tokenizer_dir):
    engine = Engine(model_path=tokenizer_dir, scheduler_entry=run_fake_scheduler)
    procs = [p for _, p in engine._runtime.processes]
    assert all(p.is_alive() for p in procs)
    engine.shutdown()
    assert not any(p.is_alive() for p in procs)
    engine.shutdown()  # idempotent
