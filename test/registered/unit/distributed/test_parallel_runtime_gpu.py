"""Parallel runtime on CUDA: nccl backend, device selection, and (with 2 GPUs) nccl collectives."""

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime, init_parallel_runtime
from sglite.srt.distributed.local_launch import run_local_ranks
from sglite.srt.distributed.parallel_state import get_attn_tp_group, get_tp_group
from sglite.srt.runtime_context import ParallelState, publish, scoped

SUITE = "gpu"
EST_TIME = 30

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_one_gpu_defaults_to_nccl_without_a_process_group():
    state = ParallelState(tp_size=1)
    with scoped(parallel=state):
        init_parallel_runtime(state, 0, 1, None, device="cuda")
        try:
            assert state.backend == "nccl" and state.attn_tp_size == 1
            assert torch.cuda.current_device() == 0
            x = torch.arange(4.0, device="cuda")
            assert get_tp_group().all_reduce(x) is x
        finally:
            destroy_parallel_runtime()


def _nccl_rank(rank, world_size, init_method):
    publish(parallel=ParallelState(tp_size=world_size))
    from sglite.srt.runtime_context import get_parallel

    init_parallel_runtime(get_parallel(), rank, world_size, init_method, device="cuda", timeout_s=60)
    t = torch.full((4,), float(rank + 1), device="cuda")
    get_tp_group().all_reduce(t)
    gathered = get_attn_tp_group().all_gather(torch.tensor([rank], device="cuda"), dim=0).tolist()
    obj = get_tp_group().broadcast_object({"from": rank} if rank == 0 else None)
    out = (get_parallel().backend, torch.cuda.current_device(), t.tolist(), gathered, obj)
    destroy_parallel_runtime()
    return out


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_nccl_collectives():
    # CUDA cannot be re-initialised in a forked child: spawn.
    res = run_local_ranks(_nccl_rank, 2, start_method="spawn", timeout_s=240)
    for rank, (backend, device, summed, gathered, obj) in enumerate(res):
        assert backend == "nccl" and device == rank
        assert summed == [3.0] * 4
        assert gathered == [0, 1]
        assert obj == {"from": 0}
