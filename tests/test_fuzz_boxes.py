"""Crafted --boxes files (issue 35, class 5): any malformed value is one line and exit status 2 (a JSON integer too
large for a float raised OverflowError: a traceback and exit 1); people per image are capped (MAX_PEOPLE: all of an
image's crops and heatmaps are held at once, ~40 MB a person). Then a seeded mutation loop over a seed file."""

import json
import math

import pytest
import torch

import predict
from fuzz_support import NASTY_VALUES, SEED_CORPUS, fuzz_loop, mutate
from sapiens2_app.predict.boxes import MAX_COORDINATE, MAX_PEOPLE, fit_boxes, pose_boxes, read_boxes_file
from sapiens2_app.common.cli import UsageError
from sapiens2_app.predict.inputs import InputImage


def boxes_file(tmp_path, text: str) -> str:
    path = tmp_path / "boxes.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, phrase", [
    ('{"a.jpg": [[0, 0, 1' + "0" * 400 + ', 10]]}', "has the box [0, 0, 1000"),  # OverflowError in math.isfinite
    ('{"a.jpg": [[-1' + "0" * 400 + ', 0, 10, 10]]}', "x, y, w, h must be finite numbers within 1e+07"),
    ('{"a.jpg": [[0, 0, 1e300, 10]]}', "x, y, w, h must be finite numbers within 1e+07"),
    ('{"a.jpg": [[0, 0, 1' + "0" * 5000 + ', 10]]}', "cannot read it as JSON (Exceeds the limit (4300 digits)"),
    ('{"a.jpg": ' + json.dumps([[0, 0, 5, 5]] * (MAX_PEOPLE + 1)) + "}",
     f"'a.jpg' has {MAX_PEOPLE + 1} boxes; at most {MAX_PEOPLE} people per image"),
])
def test_bad_values_are_one_line(tmp_path, text, phrase):
    with pytest.raises(UsageError) as refused:
        read_boxes_file(boxes_file(tmp_path, text))
    message = str(refused.value)
    assert phrase in message and "boxes.json" in message and "\n" not in message and len(message) < 500, message


def test_predict_refuses_a_huge_integer_with_exit_2_and_one_line(tmp_path, capsys):
    path = boxes_file(tmp_path, '{"a.jpg": [[0, 0, 1' + "0" * 400 + ', 10]]}')
    assert predict.main(["pose", str(tmp_path), "-o", str(tmp_path / "out"), "--boxes", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --boxes ") and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_detector_giving_more_than_max_people_keeps_the_highest_scores(tmp_path):
    image = torch.zeros(3, 100, 100, dtype=torch.uint8)
    scores = torch.linspace(0.41, 0.99, MAX_PEOPLE + 6)[torch.randperm(MAX_PEOPLE + 6)]
    detected = torch.cat([torch.tensor([[10.0, 10.0, 20.0, 30.0]]).expand(len(scores), 4), scores[:, None]], dim=1)
    boxes, source, kept, warnings = pose_boxes(InputImage(tmp_path / "a.jpg", "a.jpg"), image, None, None, detected)
    assert source == "detector" and len(boxes) == len(kept) == MAX_PEOPLE
    assert kept == sorted(scores.tolist(), reverse=True)[:MAX_PEOPLE]
    assert warnings == [f"{tmp_path / 'a.jpg'}: {MAX_PEOPLE + 6} detected people, the lowest-scoring 6 dropped "
                        f"(at most {MAX_PEOPLE} people per image)"]


# ----------------------------------------------------------------------------------------------------
# The mutation loop: byte edits of a seed file, and its numbers replaced by nasty values
# ----------------------------------------------------------------------------------------------------
def crafted_boxes(rng, seed: bytes) -> bytes:
    if rng.random() < 0.5:
        return mutate(rng, seed, max_edits=6)
    boxes = json.loads(seed)
    entry = boxes["photo.jpg"]
    box = entry[0]
    box[rng.randrange(4)] = rng.choice(NASTY_VALUES)
    if rng.random() < 0.2:
        entry.extend([[1, 1, 2, 2]] * rng.choice([MAX_PEOPLE - 1, MAX_PEOPLE + 5]))
    text = json.dumps(boxes)  # (NaN and Infinity written as such: the reader refuses them)
    if rng.random() < 0.2:  # an integer too large for a float, or for Python's int() of a string
        text = text.replace("10", "1" + "0" * rng.choice([310, 400, 4400]), 1)
    return text.encode()


def test_mutated_boxes_files_are_read_or_refused_in_one_line(tmp_path):
    seed = (SEED_CORPUS / "boxes.json").read_bytes()
    path = tmp_path / "boxes.json"

    def one(rng):
        path.write_bytes(crafted_boxes(rng, seed))
        try:
            boxes = read_boxes_file(str(path))
        except UsageError as refused:
            message = str(refused)
            assert "\n" not in message and len(message) < 600 and str(path) in message, message
            return "refused", message[len(str(path)) + 9:][:50]
        for name, entry in boxes.items():  # what was read is what the pipeline can use
            assert len(entry) <= MAX_PEOPLE
            assert all(math.isfinite(v) and abs(v) <= MAX_COORDINATE for box in entry for v in box), entry
            fit_boxes(entry, 640, 480)
        return "read", None

    tally = fuzz_loop("boxes", one, count=500, seconds=3.0)
    assert not tally.failures, tally.failures[:3]
    assert tally.counts["read"] > 0 and tally.counts["refused"] > 0, tally.counts
