"""--chat-template: a Jinja file, a JSON file holding chat_template, or a built-in name; anything else is a
flag error naming --chat-template. The built-in chatml renders like transformers' own ChatML templates."""

import json

import pytest

from sglite.srt.entrypoints.preflight import check_chat_template
from sglite.srt.managers.template_manager import BUILTIN_CHAT_TEMPLATES, load_chat_template
from sglite.srt.server_args import ServerArgs, ServerArgsError

SUITE = "unit-cpu"
EST_TIME = 3


def test_file_json_and_builtin(tmp_path):
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(jinja)) == "{{ messages[0]['content'] }}"
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": "{{ 'x' }}"}))
    assert load_chat_template(str(cfg)) == "{{ 'x' }}"
    assert load_chat_template("chatml") == BUILTIN_CHAT_TEMPLATES["chatml"]


def test_bad_values_are_flag_errors(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text(json.dumps({"other": 1}))
    for spec in ("no-such-template", str(bad_json)):
        with pytest.raises(ServerArgsError, match="--chat-template"):
            check_chat_template(ServerArgs(chat_template=spec))


def test_chatml_renders_as_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    tok.chat_template = load_chat_template("chatml")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
