"""A scheduler *test double* speaking the real ZMQ protocol, so the front end is testable without a model.

Its "model" is a fixed function of the last two tokens; it tracks a fake KV slot count so tests can
check that aborts and disconnects give every slot back. A prompt starting with token 0 followed by
token 1 ("die" sentinel) makes the process exit with code 3, to test dead-scheduler handling.
Run as a script it serves HTTP: ``python fake_scheduler.py <ServerArgs flags>``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

TOTAL_SLOTS = 4096
CONTEXT_LEN = 256
VOCAB = 512
EOS_ID = 2
STEP_S = 0.01


def fake_next_token(seq: list[int]) -> int:
    """The double's deterministic 'model'."""
    a = seq[-1] if seq else 0
    b = seq[-2] if len(seq) > 1 else 0
    return (a * 31 + b * 17 + 7) % (VOCAB - 3) + 3


@dataclass
class _Req:
    rid: str
    ids: list[int]
    max_new: int
    stop_ids: set[int]
    ignore_eos: bool
    skip: bool
    stops: list[str]
    slots: int
    out: list[int] = field(default_factory=list)


def run_fake_scheduler(server_args, port_args, rank, world_size, pipe_writer) -> None:
    """Process entry with the signature of run_scheduler_process."""
    import zmq

    from sglite.srt.managers.io_struct import (
        AbortReq, BatchTokenIDOut, BatchTokenizedGenerateReqInput, FlushCacheReq, FlushCacheReqOutput, GetInternalStateReq,
        GetInternalStateReqOutput, HealthCheckOutput, HealthCheckReq, SchedulerReady,
        TokenizedGenerateReqInput, finish_abort, finish_length, finish_stop,
    )
    from sglite.srt.managers.subprocess_watchdog import watch_parent

    watch_parent()
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(port_args.scheduler_input_ipc_name)
    send = ctx.socket(zmq.PUSH)
    send.connect(port_args.detokenizer_ipc_name)
    pipe_writer.send(SchedulerReady(TOTAL_SLOTS, 128, CONTEXT_LEN, VOCAB, {"fake": True}))
    running: dict[str, _Req] = {}
    free = TOTAL_SLOTS

    def emit(entries):
        if not entries:
            return
        send.send_pyobj(BatchTokenIDOut(
            rids=[r.rid for r, _, _ in entries], output_ids=[n for _, n, _ in entries],
            finished_reasons=[f for _, _, f in entries], prompt_tokens=[len(r.ids) for r, _, _ in entries],
            completion_tokens=[len(r.out) for r, _, _ in entries], cached_tokens=[0] * len(entries),
            spec_verify_ct=[0] * len(entries), skip_special_tokens=[r.skip for r, _, _ in entries],
            stop_strs=[r.stops for r, _, _ in entries],
        ))

    while True:
        entries = []
        pending: list = []
        while pending or recv.poll(0 if running else 50):
            msg = pending.pop(0) if pending else recv.recv_pyobj()
            if isinstance(msg, BatchTokenizedGenerateReqInput):
                pending.extend(msg.batch)
                continue
            if isinstance(msg, TokenizedGenerateReqInput):
                if msg.input_ids[:2] == [0, 1]:
                    import os
                    os._exit(3)
                sp = msg.sampling_params
                slots = len(msg.input_ids) + sp.max_new_tokens
                free -= slots
                running[msg.rid] = _Req(msg.rid, list(msg.input_ids), sp.max_new_tokens, set(sp.stop_token_ids),
                                        sp.ignore_eos, sp.skip_special_tokens, list(sp.stop), slots)
            elif isinstance(msg, AbortReq):
                rids = list(running) if msg.abort_all else [msg.rid]
                for rid in rids:
                    r = running.pop(rid, None)
                    if r is not None:
                        free += r.slots
                        entries.append((r, [], finish_abort(msg.message)))
            elif isinstance(msg, FlushCacheReq):
                send.send_pyobj(FlushCacheReqOutput(success=not running, message="requests are running" if running else ""))
            elif isinstance(msg, GetInternalStateReq):
                send.send_pyobj(GetInternalStateReqOutput({
                    "available_kv_slots": free, "max_total_num_tokens": TOTAL_SLOTS, "num_running_reqs": len(running),
                    "num_waiting_reqs": 0, "avg_spec_accept_length": None, "last_gen_throughput": 0.0,
                }))
            elif isinstance(msg, HealthCheckReq):
                send.send_pyobj(HealthCheckOutput(msg.rid))
        for rid in list(running):
            r = running[rid]
            tok = fake_next_token(r.ids + r.out)
            r.out.append(tok)
            reason = None
            if tok in r.stop_ids or (tok == EOS_ID and not r.ignore_eos):
                reason = finish_stop(tok)
            elif len(r.out) >= r.max_new:
                reason = finish_length(len(r.out))
            if reason is not None:
                del running[rid]
                free += r.slots
            entries.append((r, [tok], reason))
        emit(entries)
        if running:
            time.sleep(STEP_S)


def main(argv=None) -> int:
    """Serve HTTP with this double as the scheduler."""
    import logging

    from sglite.srt.entrypoints.http_server import launch_server
    from sglite.srt.server_args import ServerArgs

    logging.basicConfig(level=logging.INFO)
    args = ServerArgs.from_cli(argv)
    return launch_server(args, scheduler_entry=run_fake_scheduler)


if __name__ == "__main__":
    sys.exit(main())
