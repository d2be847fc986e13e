"""Evaluation items and instruction examples cut from a plain text, for measurements on real text when no
published set is at hand (benchmarks/quant_accuracy.py, benchmarks/lora_learns.py).

    items = mc_items_from_text(text, 1000, seed=0)         # HellaSwag-shaped: [{"context", "choices", "label"}]
    examples = play_instructions(text, seed=0)             # Alpaca-shaped: [{"instruction", "input", "output"}]

Multiple choice: a context of about `context_chars` characters ending at a word, then four endings of about
`choice_chars` characters: the text's own continuation (its first word is the one after the space that ends
the context, so `context + " " + the true ending` is a slice of the text) and three continuations cut the same
way from elsewhere in the text. Scoring joins context and ending with one space (eval's token split,
eval/scoring.py), so the true ending is scored exactly as it stands in the text.

Instructions: a play in Project Gutenberg's layout (a speaker's name in capitals with a full stop on a line of
its own, the speech below it, a blank line after) gives three kinds of one-line instruction, each answered
by the text itself: "Continue Name's speech: <a line>" -> the speech's next line; "Answer as Name: <a line>"
-> the first line of Name's answering speech; "Who speaks: <a line>" -> the speaker's name. The lines are
short (at most max_chars characters), so that an example in the Alpaca template fits a small model's context.
The instruction holds its text (no separate input), so `nanoeuler chat`, which takes one line a turn, can ask
it.
"""
import re

import numpy as np

SPEAKER = re.compile(r"^([A-Z][A-Z' &-]*[A-Z])\.$")   # "ROMEO." / "FIRST LORD." on a line of its own


def word_cuts(text):
    """Positions p where text[p] is a space between two non-space characters: context text[:p], ending
    text[p + 1:] joined by eval's one space give the text back."""
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    space = chars == ord(" ")
    blank = np.isin(chars, [ord(c) for c in " \t\n\r\f\v"])
    inner = np.zeros(len(chars), dtype=bool)
    inner[1:-1] = space[1:-1] & ~blank[:-2] & ~blank[2:]
    return np.flatnonzero(inner)


def _ending(text, cuts, p, choice_chars):
    """The text after the space at p, through the first space at or past choice_chars characters."""
    i = np.searchsorted(cuts, p + 1 + choice_chars)
    end = cuts[i] if i < len(cuts) else len(text)
    return text[p + 1:end].rstrip()


def mc_items_from_text(text, n, seed=0, context_chars=160, choice_chars=60, n_choices=4):
    """n multiple-choice items cut from text (see the module's docstring); the true ending's place is drawn
    at random. Distractors come from at least 10 contexts' length away and differ from every other choice.
    A ValueError where the text is too short for n items that do not overlap."""
    cuts = word_cuts(text)
    span = context_chars + choice_chars
    usable = cuts[(cuts >= context_chars) & (cuts < len(text) - choice_chars - 1)]
    if len(usable) < n or len(text) < 2 * n * span:
        raise ValueError(f"a text of {len(text):,} characters is too short for {n} items of {span} characters")
    rng = np.random.default_rng(seed)
    # item cuts spread evenly over the text (no two items share text), each nudged to a random word cut nearby
    starts = np.linspace(0, len(usable) - 1, n).round().astype(np.int64)
    step = max(1, len(usable) // n)
    items = []
    for s in starts:
        p = int(usable[min(len(usable) - 1, s + rng.integers(0, step))])
        c = np.searchsorted(cuts, p - context_chars)  # the context starts after the space of a word cut
        context = text[cuts[c] + 1 if c < len(cuts) and cuts[c] < p else p - context_chars:p]
        choices = [_ending(text, cuts, p, choice_chars)]
        while len(choices) < n_choices:
            q = int(usable[rng.integers(0, len(usable))])
            ending = _ending(text, cuts, q, choice_chars)
            if abs(q - p) > 10 * span and ending not in choices and ending.strip():
                choices.append(ending)
        label = int(rng.integers(0, n_choices))
        choices[0], choices[label] = choices[label], choices[0]
        items.append({"context": context, "choices": choices, "label": label})
    return items


def speeches(text):
    """[(speaker, [lines])] in the text's order, None for a paragraph that is no speech (a stage direction, a
    title), so that two speeches are consecutive in the play where they are next to each other here."""
    out = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in paragraph.strip().splitlines()]
        match = SPEAKER.match(lines[0]) if lines else None
        body = [line for line in lines[1:] if line and not line.startswith("[")]
        out.append((match.group(1), body) if match and body else None)
    return out


def play_instructions(text, seed=0, max_chars=40):
    """Alpaca examples of the three kinds (module docstring) from every speech of text whose lines are at most
    max_chars characters, in a shuffled order (seeded)."""
    examples = []
    said = speeches(text)
    for before, speech in zip([None] + said[:-1], said):
        if speech is None:
            continue
        name, lines = speech
        short = [line for line in lines if len(line) <= max_chars]
        if short:
            examples.append({"instruction": f"Who speaks: {short[0]}", "input": "",
                             "output": name.title()})
        if len(lines) >= 2 and max(len(lines[0]), len(lines[1])) <= max_chars:
            examples.append({"instruction": f"Continue {name.title()}'s speech: {lines[0]}", "input": "",
                             "output": lines[1]})
        if before is not None and before[0] != name:
            cue = before[1][-1]
            if max(len(cue), len(lines[0])) <= max_chars:
                examples.append({"instruction": f"Answer as {name.title()}: {cue}", "input": "",
                                 "output": lines[0]})
    order = np.random.default_rng(seed).permutation(len(examples))
    return [examples[i] for i in order]
