"""DataParallelController: dispatch (round robin, shortest queue), abort routing, merged control replies.
No processes: sockets are replaced by recording callables."""

import pytest

from sglite.srt.managers.data_parallel_controller import (
    DataParallelController,
    LoadBalancer,
)
from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    BatchTokenizedGenerateReqInput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    HealthCheckOutput,
    HealthCheckReq,
    TokenizedGenerateReqInput,
    finish_length,
)
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.server_args import ServerArgs, ServerArgsError

SUITE = "unit-cpu"
EST_TIME = 2


def _req(rid: str) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=[1, 2], sampling_params=SamplingParams(), stream=False)


def _out(rids: list[str], finished: list[bool]) -> BatchTokenIDOut:
    n = len(rids)
    return BatchTokenIDOut(
        rids=rids, output_ids=[[7]] * n, finished_reasons=[finish_length(1) if f else None for f in finished],
        prompt_tokens=[2] * n, completion_tokens=[1] * n, cached_tokens=[0] * n, spec_verify_ct=[0] * n,
        skip_special_tokens=[True] * n, stop_strs=[[]] * n,
    )


class Recorder:
    def __init__(self, dp_size: int, method: str) -> None:
        self.to_groups: list[tuple[int, object]] = []
        self.to_detok: list[object] = []
        self.ctrl = DataParallelController(dp_size, method, lambda d, m: self.to_groups.append((d, m)), self.to_detok.append)

    def groups_of(self, cls: type) -> list[int]:
        return [d for d, m in self.to_groups if isinstance(m, cls)]


def test_round_robin_cycles_groups():
    r = Recorder(3, "round_robin")
    for i in range(7):
        r.ctrl.handle_request(_req(f"r{i}"))
    assert r.groups_of(TokenizedGenerateReqInput) == [0, 1, 2, 0, 1, 2, 0]


def test_a_batch_is_split_per_group_and_stays_one_message_per_group():
    r = Recorder(2, "round_robin")
    r.ctrl.handle_request(BatchTokenizedGenerateReqInput(batch=[_req(f"r{i}") for i in range(5)]))
    assert [(d, [q.rid for q in m.batch]) for d, m in r.to_groups] == [(0, ["r0", "r2", "r4"]), (1, ["r1", "r3"])]
    r.ctrl.handle_request(_req("r5"))  # the balancer counted the batch's requests one by one
    assert r.to_groups[-1][0] == 1


def test_shortest_queue_follows_finishes():
    r = Recorder(2, "shortest_queue")
    for rid in ("a", "b", "c"):
        r.ctrl.handle_request(_req(rid))
    assert r.groups_of(TokenizedGenerateReqInput) == [0, 1, 0]  # ties go to the lowest group
    # Group 0 finishes both of its requests: the next two go to group 0 (0 in flight vs 1).
    r.ctrl.handle_output(0, _out(["a", "c"], [True, True]))
    r.ctrl.handle_request(_req("d"))
    assert r.groups_of(TokenizedGenerateReqInput)[-1] == 0
    # A non-final output does not change the count.
    r.ctrl.handle_output(1, _out(["b"], [False]))
    r.ctrl.handle_request(_req("e"))
    assert r.groups_of(TokenizedGenerateReqInput)[-1] == 0  # 1 vs 1: lowest group
    assert r.ctrl.balancer.num_in_flight == [2, 1]
    assert len(r.to_detok) == 2  # token outputs are forwarded unchanged


def test_abort_goes_to_owner_only_and_unknown_to_all():
    r = Recorder(2, "round_robin")
    r.ctrl.handle_request(_req("x"))
    r.ctrl.handle_request(_req("y"))
    r.to_groups.clear()
    r.ctrl.handle_request(AbortReq(rid="y"))
    assert r.groups_of(AbortReq) == [1]
    r.to_groups.clear()
    r.ctrl.handle_output(1, _out(["y"], [True]))
    r.ctrl.handle_request(AbortReq(rid="y"))  # finished already: every group treats it as a no-op
    r.ctrl.handle_request(AbortReq(rid="", abort_all=True))
    assert r.groups_of(AbortReq) == [0, 1, 0, 1]


def test_control_requests_fan_out_and_merge():
    r = Recorder(2, "round_robin")
    r.ctrl.handle_request(GetInternalStateReq())
    r.ctrl.handle_request(FlushCacheReq())
    r.ctrl.handle_request(HealthCheckReq(rid="h"))
    assert r.groups_of(GetInternalStateReq) == [0, 1] and r.groups_of(FlushCacheReq) == [0, 1]
    s0 = {"available_kv_slots": 10, "num_running_reqs": 1, "num_waiting_reqs": 0, "max_total_num_tokens": 100,
          "avg_spec_accept_length": 2.0, "last_gen_throughput": 1.0, "num_retractions": 0}
    s1 = dict(s0, available_kv_slots=20, num_running_reqs=2, max_total_num_tokens=90, avg_spec_accept_length=None)
    # Replies arrive out of order across groups; nothing is sent until every group answered.
    r.ctrl.handle_output(1, GetInternalStateReqOutput(internal_state=s1))
    r.ctrl.handle_output(1, FlushCacheReqOutput(success=False, message="busy"))
    assert r.to_detok == []
    r.ctrl.handle_output(0, FlushCacheReqOutput(success=True))
    r.ctrl.handle_output(0, GetInternalStateReqOutput(internal_state=s0))
    r.ctrl.handle_output(0, HealthCheckOutput(rid="h"))
    r.ctrl.handle_output(1, HealthCheckOutput(rid="h"))
    flush, state, health = r.to_detok
    assert isinstance(flush, FlushCacheReqOutput) and not flush.success and "group 1: busy" in flush.message
    merged = state.internal_state
    assert merged["available_kv_slots"] == 30 and merged["num_running_reqs"] == 3
    assert merged["max_total_num_tokens"] == 90 and merged["avg_spec_accept_length"] == 2.0
    assert [s["dp_rank"] for s in merged["dp_internal_states"]] == [0, 1]
    assert merged["dp_internal_states"][1]["available_kv_slots"] == 20
    assert isinstance(health, HealthCheckOutput)


def test_unrequested_reply_is_an_error():
    r = Recorder(2, "round_robin")
    with pytest.raises(RuntimeError, match="unrequested"):
        r.ctrl.handle_output(0, HealthCheckOutput(rid="h"))


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="--load-balance-method"):
        LoadBalancer(2, "random")
    with pytest.raises(ServerArgsError, match="--load-balance-method"):
        ServerArgs(load_balance_method="random").validate()


def test_a_prefill_node_follows_the_bootstrap_room():
    """PD prefill node: group = room % dp (the decode node computes the same); a request without a room round-robins."""
    r = Recorder(2, "follow_bootstrap_room")
    for room in (7, 4, 9, 10):
        req = _req(f"r{room}")
        req.bootstrap_room = room
        r.ctrl.handle_request(req)
    r.ctrl.handle_request(_req("no-room"))
    assert r.groups_of(TokenizedGenerateReqInput) == [1, 0, 1, 0, 0]
    assert ServerArgs(disaggregation_mode="prefill", dp_size=2, tp_size=2, enable_dp_attention=True).validate() \
        .resolved_load_balance_method() == "follow_bootstrap_room"
    assert ServerArgs(dp_size=2).validate().resolved_load_balance_method() == "round_robin"
    with pytest.raises(ServerArgsError, match="needs --load-balance-method follow_bootstrap_room"):
        ServerArgs(disaggregation_mode="prefill", dp_size=2, load_balance_method="shortest_queue").validate()
