"""Items and instructions cut from a text (nanoeuler/data/text_tasks.py): the true ending of an item is the text's
own continuation, scored as eval joins it; the instructions are answered by the text."""
import os

import pytest

from conftest import ROOT
from nanoeuler.data.text_tasks import mc_items_from_text, play_instructions, speeches, word_cuts

PLAY = """ACT I.

SCENE 1. A street.

[Enter ROMEO and BENVOLIO.]

BENVOLIO.
Good morrow, cousin.

ROMEO.
Is the day so young?
But new struck nine.

[Exit BENVOLIO.]

FIRST CITIZEN.
Clubs, bills, and partisans!
"""


@pytest.fixture(scope="module")
def text():
    with open(os.path.join(ROOT, "shakespeare.txt"), encoding="utf-8") as f:
        return f.read()[-400_000:]


def test_the_true_ending_is_the_texts_continuation(text):
    items = mc_items_from_text(text, 300, seed=3)
    assert len(items) == 300
    for item in items:
        context, choices = item["context"], item["choices"]
        assert len(choices) == 4 and len(set(choices)) == 4
        # eval joins context and choice with one space (eval/scoring.py): that is the text itself
        assert context + " " + choices[item["label"]] in text
        assert not context[-1].isspace() and not context[0].isspace()
        assert all(c and not c[0].isspace() and not c[-1].isspace() for c in choices)
        assert 100 <= len(context) <= 160 and all(len(c) >= 60 for c in choices)
        # a distractor is no continuation of this context
        assert all(context + " " + c not in text for i, c in enumerate(choices) if i != item["label"])
    labels = [item["label"] for item in items]
    assert all(50 < labels.count(k) < 100 for k in range(4))  # the true ending's place is drawn
    assert mc_items_from_text(text, 300, seed=3) == items


def test_items_need_enough_text():
    with pytest.raises(ValueError, match="too short"):
        mc_items_from_text("a few words only " * 20, 10)


def test_word_cuts_are_single_spaces_between_words():
    assert list(word_cuts("ab cd  e\nf g")) == [2, 10]


def test_instructions_are_answered_by_the_play():
    assert [s[0] if s else None for s in speeches(PLAY)] == [None, None, None, "BENVOLIO", "ROMEO", None,
                                                             "FIRST CITIZEN"]
    examples = sorted(play_instructions(PLAY), key=lambda e: e["instruction"])
    assert examples == [
        {"instruction": "Answer as Romeo: Good morrow, cousin.", "input": "", "output": "Is the day so young?"},
        {"instruction": "Continue Romeo's speech: Is the day so young?", "input": "", "output": "But new struck nine."},
        {"instruction": "Who speaks: Clubs, bills, and partisans!", "input": "", "output": "First Citizen"},
        {"instruction": "Who speaks: Good morrow, cousin.", "input": "", "output": "Benvolio"},
        {"instruction": "Who speaks: Is the day so young?", "input": "", "output": "Romeo"},
    ]
