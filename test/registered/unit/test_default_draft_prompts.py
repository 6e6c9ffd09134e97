"""The default draft's prompt set (scripts/default_draft_prompts.py): the by-subject held-out split, and
that MORE_TEMPLATES only append training prompts (earlier reply chunks and the held-out list
stay as they were)."""

from pathlib import Path

import pytest

from sglite.testing.scripts import load_script

SUITE = "unit-cpu"
EST_TIME = 5

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def prompts():
    return load_script(REPO / "scripts" / "default_draft_prompts.py")


def test_no_held_out_subject_reaches_a_training_prompt(prompts):
    train, heldout = prompts.build_prompts()
    assert not set(train) & set(heldout)
    assert len(set(train)) == len(train)
    train_set = set(train)
    for template, kind in prompts.TEMPLATES + prompts.MORE_TEMPLATES:
        if kind not in prompts.KINDS:
            continue  # math and pair subjects are checked below through their own split key
        for subject in prompts._clean(prompts.KINDS[kind]):
            if prompts._heldout_subject(subject, 12):
                assert template.format(x=subject) not in train_set, (template, subject)
    for text in prompts.EXTRA_HELDOUT:
        assert text in heldout and text not in train_set


def test_more_templates_append_and_leave_the_held_out_list_alone(prompts, monkeypatch):
    train, heldout = prompts.build_prompts()
    monkeypatch.setattr(prompts, "MORE_TEMPLATES", [])
    base_train, base_heldout = prompts.build_prompts()
    assert len(base_train) == 3260 and len(heldout) == 406  # the lists reply chunks 0-24 were built from
    assert train[: len(base_train)] == base_train
    assert heldout == base_heldout
    assert len(train) >= 6400  # --num-prompts 6400 needs them
