"""The seeded mutation loop of the fuzz tests (tests/test_fuzz_*.py): standard-library `random`, bounded in count
and in time, so a run in `make test` costs a few seconds and finds the same inputs on every machine.

    for rng in fuzz_inputs("checkpoints", count=150):
        data = mutate(rng, seed_bytes)
        outcome = ...  # the parser under test; the test asserts every outcome is an answer the docs allow
        tally.add(outcome)

A long run outside `make test` is the same tests with more time: FUZZ_SECONDS=600 makes each loop run that many
seconds (no count limit), FUZZ_SEED picks another seed, and FUZZ_REPORT=dir writes each loop's tally (inputs tried,
how each was answered) to dir/<name>.json:

    FUZZ_SECONDS=600 FUZZ_REPORT=fuzz-report nice python -m pytest tests/test_fuzz_boxes.py -q
"""

from __future__ import annotations

import collections
import json
import os
import random
import time
from pathlib import Path

SEED_CORPUS = Path(__file__).parent / "fixtures" / "fuzz"

# Values a parser of numbers, strings and lists meets in the wild and in crafted files.
NASTY_VALUES = [
    float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 1e-320, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63),
    10**400, 0.5, -0.0, True, False, None, "", "nan", "pointmap", "\x00", "é", "²", [], [1], [0, 0], [1, 2, 3],
    [[1, 2]], {}, {"a": 1}, 1e38, -1e38, 100000,
]


def long_run_seconds() -> float | None:
    value = os.environ.get("FUZZ_SECONDS")
    return float(value) if value else None


def fuzz_inputs(name: str, count: int, seconds: float = 8.0):
    """One seeded `random.Random` per input, `count` of them or as many as `seconds` allow, whichever ends first
    (FUZZ_SECONDS: that many seconds, no count limit). Each input's generator is seeded from (FUZZ_SEED, name,
    index), so a failing input is reproduced by its index alone."""
    limit = long_run_seconds()
    seconds, count = (limit, None) if limit else (seconds, count)
    base = os.environ.get("FUZZ_SEED", "0")
    end = time.monotonic() + seconds
    index = 0
    while (count is None or index < count) and time.monotonic() < end:
        yield random.Random(f"{base}:{name}:{index}")
        index += 1


def mutate(rng: random.Random, data: bytes, max_edits: int = 4) -> bytes:
    """`data` with a few byte edits: flips, inserts, deletes, repeats, truncation, interesting bytes."""
    data = bytearray(data)
    for _ in range(rng.randint(1, max_edits)):
        at = rng.randrange(len(data) + 1)
        edit = rng.randrange(6)
        if edit == 0 and at < len(data):
            data[at] ^= 1 << rng.randrange(8)
        elif edit == 1:
            data[at:at] = bytes([rng.choice((0, 0xFF, 0x7F, 0x80, ord('"'), ord("\\"), ord(";"), ord("*"), 0xC3))])
        elif edit == 2:
            del data[at:at + rng.randint(1, 8)]
        elif edit == 3:
            data[at:at] = data[at:at + rng.randint(1, 16)] * rng.randint(1, 8)
        elif edit == 4:
            del data[at:]
        elif at < len(data):
            data[at] = rng.randrange(256)
    return bytes(data)


class Tally:
    """How each input of a loop was answered: counts by outcome, and one example input per outcome."""

    def __init__(self, name: str):
        self.name, self.counts, self.examples = name, collections.Counter(), {}

    def add(self, outcome: str, example=None):
        self.counts[outcome] += 1
        self.examples.setdefault(outcome, example)

    def total(self) -> int:
        return sum(self.counts.values())

    def report(self):
        """Written to $FUZZ_REPORT/<name>.json when set (the long run's record)."""
        folder = os.environ.get("FUZZ_REPORT")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            record = {"inputs": self.total(), "outcomes": dict(self.counts.most_common()),
                      "examples": {k: repr(v)[:300] for k, v in self.examples.items()}}
            (Path(folder) / f"{self.name}.json").write_text(json.dumps(record, indent=2))
