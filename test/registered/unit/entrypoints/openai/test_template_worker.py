"""The client chat-template worker: renders as transformers does, is killed past its time limit and replaced."""

import time

import pytest

from sglite.srt.entrypoints.openai.template_worker import TemplateRenderError, TemplateWorker

SUITE = "unit-cpu"
EST_TIME = 12

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}{{ suffix }}"
)


@pytest.fixture(scope="module")
def worker():
    w = TemplateWorker(timeout_s=1.0)
    yield w
    w.close()


async def test_renders_like_transformers(worker, tokenizer):
    want = tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=True, suffix="!")
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    assert await worker.render(TEMPLATE, MESSAGES, {**special, "suffix": "!"}, 10_000) == want


async def test_a_looping_template_is_killed_and_the_worker_replaced(worker):
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    await worker.render("ok", MESSAGES, {}, 100)  # started and warm
    pid = worker._proc.pid
    t = time.monotonic()
    with pytest.raises(TemplateRenderError, match="did not render within 1 s"):
        await worker.render(looping, MESSAGES, {}, 100)
    assert time.monotonic() - t < 3.0
    assert await worker.render("{{ messages[1].content }}", MESSAGES, {}, 100) == "héllo"
    assert worker._proc.pid != pid


@pytest.mark.parametrize(
    "template, match",
    [
        ("{% for %}", "could not apply the chat template"),  # syntax error
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{{ ().__class__.__base__.__subclasses__() }}", "could not apply the chat template"),  # sandboxed
        ("{% for i in range(50000) %}xxxxxxxxxx{% endfor %}", "the limit is 1000"),
    ],
)
async def test_bad_templates_are_client_errors(worker, template, match):
    with pytest.raises(TemplateRenderError, match=match):
        await worker.render(template, MESSAGES, {}, 1000)
