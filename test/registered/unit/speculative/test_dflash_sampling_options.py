"""Penalties, logit_bias, min_new_tokens, stop_token_ids and ignore_eos with speculative decoding off, DFLASH
and DSPARK: greedy tokens equal transformers with its own logits processors applied, so the verify judges
drafts against the same processed distribution, whose penalty state advances draft by draft."""

import pytest

from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.testing.penalty_reference import hf_processed_greedy
from sglite.testing.tiny_dflash import build_tiny_dspark_draft

from test_dflash_worker import generate, plain_scheduler, spec_scheduler, trained  # noqa: F401  (same directory; trained is a fixture)

SUITE = "unit-cpu"
EST_TIME = 60

MAX_NEW = 16


@pytest.fixture(scope="module")
def pair(trained, tmp_path_factory):
    """The trained DFLASH pair of test_dflash_worker plus a DSPARK draft (a Markov head on its weights)."""
    target_dir, tr, target, _ = trained
    dspark_dir = build_tiny_dspark_draft(str(tmp_path_factory.mktemp("dspark_options")), tr.draft_dir, markov_rank=8, markov_scale=1.0)
    return target_dir, tr, dspark_dir, target


def cases(target, prompt):
    """One SamplingParams per option; the bias and stop ids target tokens of the plain greedy run."""
    plain = hf_processed_greedy(target, prompt, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
    g = dict(max_new_tokens=MAX_NEW, temperature=0.0)
    return {
        "repetition": SamplingParams(repetition_penalty=1.5, **g),
        "frequency+presence": SamplingParams(frequency_penalty=0.7, presence_penalty=0.5, **g),
        "logit_bias": SamplingParams(logit_bias={str(plain[3]): -100.0, str(plain[6]): 2.0}, **g),
        "min_tokens+stop_ids": SamplingParams(min_new_tokens=8, stop_token_ids=[plain[2]], **g),
        "stop_ids": SamplingParams(stop_token_ids=[plain[5]], **g),
        "ignore_eos": SamplingParams(ignore_eos=True, **g),
        "all": SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                              logit_bias={str(plain[1]): -100.0}, min_new_tokens=4, **g),
    }


def test_options_lossless_with_and_without_speculation(pair):
    target_dir, tr, dspark_dir, target = pair
    prompts = tr.prompts[:3]  # the draft's training trajectories: long accepted runs at first
    names, params, refs, rows = [], [], [], []
    for prompt in prompts:
        for name, p in cases(target, prompt).items():
            names.append(name)
            params.append(p.verify())
            refs.append(hf_processed_greedy(target, prompt, p))
            rows.append(prompt)
    with plain_scheduler(target_dir) as sched:
        plain = generate(sched, rows, params)
    with spec_scheduler(target_dir, tr.draft_dir) as (sched, _):
        dflash = generate(sched, rows, params)
    with spec_scheduler(target_dir, dspark_dir, speculative_algorithm="DSPARK") as (sched, _):
        dspark = generate(sched, rows, params)
    # Each option changes the reference output for some prompt (vs ignore_eos, which equals plain greedy here).
    changed = {n for i, n in enumerate(names) if refs[i] != refs[i - i % 7 + 5]}
    assert changed >= {"repetition", "frequency+presence", "logit_bias", "min_tokens+stop_ids", "stop_ids", "all"}, changed
    for i, name in enumerate(names):
        rid = f"r{i}"
        assert plain.ids[rid] == refs[i], f"{name} (prompt {i // 7}): plain != transformers"
        assert dflash.ids[rid] == refs[i], f"{name} (prompt {i // 7}): DFLASH != transformers"
        assert dspark.ids[rid] == refs[i], f"{name} (prompt {i // 7}): DSPARK != transformers"
    # Penalized requests did accept several drafts in one verify (the in-block state advance was used).
    penalized = [i for i, n in enumerate(names) if n in ("repetition", "frequency+presence", "all")]
    assert any(max(dflash.steps[f"r{i}"][1:]) > 1 for i in penalized)
