"""The seeded mutation loop of the fuzz tests (tests/test_fuzz_*.py): standard-library `random`, bounded in count
and in time, so a run in `make test` costs a few seconds and finds the same inputs on every machine.

    def one(rng):                        # one input: make it, feed it to the parser, check the answer
        data = mutate(rng, seed_bytes)
        ...                              # assert that the answer is one the docs allow
        return "refused", why            # how it was answered (counted), and an example of it

    tally = fuzz_loop("checkpoints", one, count=150)   # every input, even after a failing one
    assert not tally.failures, tally.failures[:3]

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


def fuzz_loop(name: str, one, count: int, seconds: float = 8.0) -> "Tally":
    """`one(rng)` on every input of fuzz_inputs(name, count, seconds), tallied by the (outcome, example) it returns.
    An input whose check fails, or that raises anything else, is tallied as a failure with its index (FUZZ_SEED and
    the index reproduce it) and the loop goes on, so that a long run counts every input. The tally is reported."""
    tally = Tally(name)
    for index, rng in enumerate(fuzz_inputs(name, count, seconds)):
        try:
            outcome, example = one(rng)
        except Exception as error:  # noqa: BLE001 (AssertionError: a check failed; anything else escaped the parser)
            tally.fail(index, error)
            continue
        tally.add(outcome, example)
    tally.report()
    return tally


class Tally:
    """How each input of a loop was answered: counts by outcome, one example input per outcome, and the failures."""

    def __init__(self, name: str):
        self.name, self.counts, self.examples, self.failures = name, collections.Counter(), {}, []

    def add(self, outcome: str, example=None):
        self.counts[outcome] += 1
        self.examples.setdefault(outcome, example)

    def fail(self, index: int, error: Exception):
        what = f"{type(error).__name__}: {error}"[:2000]
        self.add(f"FAILED {type(error).__name__}", what)
        self.failures.append(f"input {index}: {what}")

    def total(self) -> int:
        return sum(self.counts.values())

    def report(self):
        """Written to $FUZZ_REPORT/<name>.json when set (the long run's record)."""
        folder = os.environ.get("FUZZ_REPORT")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            record = {"inputs": self.total(), "outcomes": dict(self.counts.most_common()),
                      "examples": {k: repr(v)[:300] for k, v in self.examples.items()}, "failures": self.failures}
            (Path(folder) / f"{self.name}.json").write_text(json.dumps(record, indent=2))
