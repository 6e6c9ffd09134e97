"""Failure isolation through a real DFLASH server: a fault inside one request's sampling or detokenization
fails that request only (HTTP 500 with an OpenAI-style body), a concurrent request is served in full, the
server stays healthy, every KV slot is free afterwards and the aborts are counted in /metrics.

The faults are injected below request validation by a ``sitecustomize`` module on the server's
PYTHONPATH (test-only; nothing in sglite knows about it): a batch holding a request with seed 666
raises in SamplingBatchInfo, and the detokenizer raises a TypeError for rids starting "poison-detok"
(what ``"skip_special_tokens": "no"`` once did to the whole detokenizer process).
"""

import concurrent.futures as cf
import os
import re

import httpx
import pytest

from conftest import ServerProcess

SUITE = "e2e-cpu"
EST_TIME = 40

pytestmark = pytest.mark.timeout(300)

POISON_SEED = 666

SITECUSTOMIZE = f'''
from sglite.srt.managers import detokenizer_manager
from sglite.srt.sampling import sampling_batch_info

_build = sampling_batch_info.SamplingBatchInfo.from_sampling_params.__func__


def _poisoned_build(cls, params, *args, **kwargs):
    if any(p.seed == {POISON_SEED} for p in params):
        raise ValueError("injected sampling fault")
    return _build(cls, params, *args, **kwargs)


sampling_batch_info.SamplingBatchInfo.from_sampling_params = classmethod(_poisoned_build)
_feed = detokenizer_manager.IncrementalDetokenizer.feed


def _poisoned_feed(self, rid, *args, **kwargs):
    if rid.startswith("poison-detok"):
        raise TypeError("injected detokenizer fault")
    return _feed(self, rid, *args, **kwargs)


detokenizer_manager.IncrementalDetokenizer.feed = _poisoned_feed
'''


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from sglite.testing.tiny_dflash import TinyDraftSpec, build_tiny_dflash_draft

    d = tmp_path_factory.mktemp("faults")
    # A random draft over the 2-layer tiny target: acceptance is low, the verify path runs all the same.
    draft = build_tiny_dflash_draft(str(d / "draft"), tiny_model_dir, spec=TinyDraftSpec(target_layer_ids=(0, 1)))
    inject = d / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(inject)] + ([old] if old else []))
    try:
        srv = ServerProcess(
            tiny_model_dir, str(d / "server.log"), "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", draft, "--enable-metrics", "--decode-log-interval", "4",
        )
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    yield srv
    srv.stop()


def _completion(server, **body):
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, **body}
    return httpx.post(server.base + "/v1/completions", json=body, headers=server.headers, timeout=120)


def _generate(server, **body):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 24, "temperature": 0}, **body}
    return httpx.post(server.base + "/generate", json=body, headers=server.headers, timeout=120)


def _state(server):
    return httpx.get(server.base + "/get_server_info", headers=server.headers, timeout=30).json()["internal_states"][0]


def test_faults_fail_their_request_only_and_free_every_slot(server):
    normal = _completion(server, ignore_eos=True)
    assert normal.status_code == 200, normal.text
    with cf.ThreadPoolExecutor(4) as pool:
        bystander = pool.submit(_completion, server, ignore_eos=True)
        bad_sampling = pool.submit(_completion, server, seed=POISON_SEED)
        bad_detok = pool.submit(_generate, server, rid="poison-detok-1")
        bystander2 = pool.submit(_generate, server, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
        results = [f.result() for f in (bystander, bad_sampling, bad_detok, bystander2)]
    ok, bad_s, bad_d, ok2 = results
    for bad, what in ((bad_s, "injected sampling fault"), (bad_d, "injected detokenizer fault")):
        assert bad.status_code == 500, bad.text
        err = bad.json()  # error_body: the OpenAI-style object SGLang and vLLM return
        assert err["object"] == "error" and err["type"] == "InternalServerError" and err["code"] == 500
        assert what in err["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == normal.json()["choices"][0]["text"]
    assert ok.json()["usage"]["completion_tokens"] == 24
    assert ok2.status_code == 200 and ok2.json()["meta_info"]["completion_tokens"] == 24

    # The server keeps serving, with all processes alive, and every KV slot comes back.
    assert httpx.get(server.base + "/health").status_code == 200 and server.proc.poll() is None
    assert _completion(server, ignore_eos=True).json()["choices"][0]["text"] == normal.json()["choices"][0]["text"]
    assert httpx.post(server.base + "/flush_cache", headers=server.headers, timeout=30).status_code == 200
    st = _state(server)
    assert st["available_kv_slots"] == st["initial_free_slots"] and st["num_running_reqs"] == 0

    metrics = httpx.get(server.base + "/metrics").text
    assert re.search(r'sglite:num_aborted_requests_total\{model_name="tiny"\} 2\.0', metrics), metrics
    log = server.output()
    assert "Abort request" in log and "internal error" in log
    assert re.search(r"Decode batch\. #running-req: \d+, #token: \d+, token usage: \d\.\d\d, accept len: \d+\.\d\d, ", log)


def test_temperature_1e_39_with_dflash_is_greedy(server):
    """Regression: `temperature: 1e-39` with DFLASH on made the verify probabilities NaN and killed the server."""
    tiny = _completion(server, temperature=1e-39, ignore_eos=True)
    greedy = _completion(server, temperature=0, ignore_eos=True)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert httpx.get(server.base + "/health").status_code == 200


def test_context_length_is_the_models(server, tiny_model_dir):
    """The DFLASH block is reserved inside the model's limit: advertised == the model's, not model + B + 1."""
    import json

    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        model_max = json.load(f)["max_position_embeddings"]
    info = httpx.get(server.base + "/get_model_info", headers=server.headers).json()
    models = httpx.get(server.base + "/v1/models", headers=server.headers).json()["data"][0]
    assert info["context_length"] == models["max_model_len"] == model_max
