"""The license_cloze task's data: `load` gives lm-eval the committed items; running this file
rebuilds them from the license texts every Debian system ships (package base-files).

Each item is a sentence of the GPL-3 or the Apache-2.0 license cut at a seeded word (the seventh or
later): the context is the words before it, the choices are that word and the cut words of three
other sentences, in a seeded order.
"""

from __future__ import annotations

import json
import os
import random
import re

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "license_cloze.jsonl")
SOURCES = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
NUM_ITEMS = 6


def load(**_metadata):
    """lm-eval's `custom_dataset`: the items as the test split."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": DATA})


def sentences(path: str) -> list[list[str]]:
    """The words of the plain sentences (12 to 40 words, no quotes) of a license text."""
    with open(path) as f:
        text = " ".join(f.read().split())
    return [s.split() for s in re.split(r"(?<=[.;])\s+", text) if 12 <= len(s.split()) <= 40 and '"' not in s]


def build() -> list[dict]:
    rng = random.Random(0)
    pool = [words for path in SOURCES for words in sentences(path)]
    cuts = []
    for words in rng.sample(pool, len(pool)):
        i = rng.randrange(6, len(words))
        word = words[i].strip(",.;()")
        if word.isalpha():
            cuts.append((" ".join(words[:i]), word))
    answers = sorted({word for _, word in cuts})
    items = []
    for context, word in cuts[:NUM_ITEMS]:
        choices = rng.sample([a for a in answers if a != word], 3) + [word]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "gold": choices.index(word)})
    return items


if __name__ == "__main__":
    with open(DATA, "w") as f:
        for item in build():
            f.write(json.dumps(item) + "\n")
