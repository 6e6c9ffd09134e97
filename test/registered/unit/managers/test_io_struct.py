"""io_struct: request splitting/validation, PortArgs endpoints, pickling over the ZMQ wire."""

import os
import pickle

import pytest

from sglite.srt.managers.io_struct import (
    BatchTokenIDOut,
    GenerateReqInput,
    PortArgs,
    TokenizedGenerateReqInput,
    finish_length,
)
from sglite.srt.sampling.sampling_params import SamplingParams

SUITE = "unit-cpu"
EST_TIME = 2


def test_single_text_request_gets_rid():
    parts = GenerateReqInput(text="hello", sampling_params={"max_new_tokens": 4}).split()
    assert len(parts) == 1
    assert parts[0].text == "hello" and parts[0].rid
    assert parts[0].sampling_params == {"max_new_tokens": 4}


def test_batch_split_broadcasts_params_and_keeps_rids():
    req = GenerateReqInput(input_ids=[[1, 2], [3]], sampling_params=[{"top_k": 1}, {"top_k": 2}], rid=["a", "b"])
    parts = req.split()
    assert [p.input_ids for p in parts] == [[1, 2], [3]]
    assert [p.rid for p in parts] == ["a", "b"]
    assert [p.sampling_params["top_k"] for p in parts] == [1, 2]
    shared = GenerateReqInput(text=["x", "y", "z"], sampling_params={"max_new_tokens": 2}, rid="r").split()
    assert [p.rid for p in shared] == ["r-0", "r-1", "r-2"]
    assert all(p.sampling_params == {"max_new_tokens": 2} for p in shared)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": 3}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, "x"]}, "input_ids"),
        ({"input_ids": [[1], []]}, "input_ids"),
        ({"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
        ({"text": "a", "rid": ["a"]}, "rid"),
        ({"text": "a", "sampling_params": [1]}, "sampling_params"),
        ({"text": "a", "sampling_params": "hot"}, "sampling_params"),
    ],
)
def test_invalid_shapes_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GenerateReqInput(**kwargs).split()


def test_port_args_are_distinct_ipc_paths_in_a_private_dir():
    pa = PortArgs.create()
    names = [pa.scheduler_input_ipc_name, pa.detokenizer_ipc_name, pa.tokenizer_ipc_name]
    assert len(set(names)) == 3
    for n in names:
        assert n.startswith("ipc://") and os.path.dirname(n[len("ipc://"):]) == pa.ipc_dir
    assert os.path.isdir(pa.ipc_dir)
    assert pa.dist_init_method.startswith("tcp://127.0.0.1:")


def test_messages_round_trip_through_pickle():
    msg = TokenizedGenerateReqInput(rid="r", input_text="hi", input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=3))
    assert pickle.loads(pickle.dumps(msg)) == msg
    out = BatchTokenIDOut(
        rids=["r"], output_ids=[[5, 6]], finished_reasons=[finish_length(2)], prompt_tokens=[2],
        completion_tokens=[2], cached_tokens=[0], spec_verify_ct=[1], skip_special_tokens=[True], stop_strs=[[]],
    )
    assert pickle.loads(pickle.dumps(out)) == out
