"""A real server with --enable-torch-compile: it compiles at start-up, and batched greedy decoding through
the compiled graph gives transformers' tokens over /generate and the openai client."""

import httpx
import openai
import pytest
import torch

from conftest import API_KEY, ServerProcess
from sglite.srt.model_executor.compiled_decode_runner import cpp_compiler
from sglite.testing.greedy_margin import assert_clear_greedy_margins

SUITE = "e2e-cpu"
EST_TIME = 60

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(cpp_compiler() is None, reason="Inductor's CPU backend needs g++ (or $CXX)"),
]
EOS = 2


def test_compiled_server_batched_greedy_equals_transformers(tiny_model_dir, hf_model, hf_tokenizer, tmp_path):
    prompts = [[11, 12, 13, 14], [200, 7], [5, 6, 7, 8, 9, 10], [300, 301, 302]]  # one batch of 4: compiled
    refs = []
    with torch.no_grad():
        for p in prompts:
            g = hf_model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=EOS,
                                  pad_token_id=EOS)[0, len(p):].tolist()
            refs.append(g[: g.index(EOS) + 1] if EOS in g else g)
    assert_clear_greedy_margins(hf_model, prompts, refs)  # fused fp32 math: equality needs clear margins
    log = tmp_path / "server.log"
    srv = ServerProcess(tiny_model_dir, str(log), "--enable-torch-compile", "--torch-compile-max-bs", "8",
                        timeout_s=240)
    try:
        text = log.read_text()
        assert "Compile decode forward (torch.compile) begin: batch sizes 1 to 8, DECODE" in text
        assert "Compile decode forward (torch.compile) end. elapsed=" in text
        r = httpx.post(srv.base + "/generate", headers=srv.headers, timeout=120, json={
            "input_ids": prompts, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == refs
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        out = client.completions.create(model="tiny", prompt=hf_tokenizer.decode(prompts[0]), max_tokens=8,
                                        temperature=0)
        assert out.choices[0].text and out.usage.completion_tokens >= 1
    finally:
        srv.stop()
