"""Crafted checkpoints (issue 35, class 3): every config field read from a file is checked for type and range
before anything is built, so a bad file is refused at load, at once, naming the file and the field; never a hang,
a memory blow-up, NaN outputs or an error at the first forward. Then a seeded mutation loop (tests/fuzz_support.py)
over the metadata and the header bytes."""

import json
import math
import time
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fuzz_support import NASTY_VALUES, fuzz_loop, mutate
from sapiens2 import Sapiens2, Sapiens2Config, heads, weights

# Refusals are checks of a few dozen fields and, for the scale branch, a search over at most 4096 feature lengths;
# the tiny models here load in ~20 ms. A second is 50x that: generous on 2 shared cores, far from the minutes
# the unchecked fields took (depth 2**63: until a MemoryError; a scale width of 10**12: endless).
REFUSAL_SECONDS = 1.0


def tiny_pointmap(image_size=(256, 192), scale_convs=(8, 8, 4)):
    config = Sapiens2Config(embed_dim=32, depth=2, num_heads=2, full_attention_first=1, full_attention_last=1,
                            image_size=image_size)
    head = heads.HeadConfig("pointmap", (8,), (8,), 3, scale_conv_channels=scale_convs, scale_hidden=(4,))
    return heads.build_task_model(config, head).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(tensors, metadata) of a tiny pointmap checkpoint written by weights.save."""
    path = weights.save(tiny_pointmap(), tmp_path_factory.mktemp("seed") / "pointmap.safetensors")
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def write_variant(path, saved, config=None, head=None, tensors=None, metadata=None):
    """The saved checkpoint with some metadata config fields (or whole metadata strings) and tensors replaced."""
    base, meta = saved
    meta = dict(meta)
    for key, patch in (("sapiens2_config", config), ("sapiens2_head_config", head)):
        if patch:
            meta[key] = json.dumps({**json.loads(meta[key]), **patch})  # (json.dumps writes NaN, as a crafted file may)
    meta.update(metadata or {})
    save_file({**base, **(tensors or {})}, str(path), metadata=meta)
    return path


def refusal(path) -> str:
    start = time.process_time()  # (CPU time: the work a refusal does, not how the machine's cores were shared)
    with pytest.raises(weights.CheckpointError) as error:
        weights.load(path)
    assert time.process_time() - start < REFUSAL_SECONDS
    message = str(error.value)
    assert str(path) in message
    return message


@pytest.mark.parametrize("field, value, phrase", [
    ("depth", 2**63, "'depth' must be in [1, 512]"),  # memory grew 60-100 MB/s until a MemoryError
    ("depth", 100000, "'depth' must be in [1, 512]"),  # still loading after 125 s at 2.3 GB
    ("norm_eps", float("nan"), "'norm_eps' must be finite"),  # loaded; every output NaN
    ("rope_base", float("nan"), "'rope_base' must be finite"),
    ("rope_base", float("inf"), "'rope_base' must be finite"),
    ("norm_eps", "pointmap", "'norm_eps' must be a number"),  # loaded; every forward a TypeError
    ("norm_eps", 0.0, "'norm_eps' must be in"),
    ("embed_dim", True, "'embed_dim' must be an integer"),
    ("image_size", [64], "'image_size' must have 2 entries"),
    ("kv_heads_per_layer", [1] * 100000, "'kv_heads_per_layer' has 100000 entries"),
    ("hidden_act", ["silu"], "'hidden_act' must be a string"),
    pytest.param("drop_path_rate", 10**400, "'drop_path_rate' must be in [0, 1], got an integer of 1329 bits",
                 id="drop_path_rate-10**400"),
])
def test_bad_backbone_fields_are_refused_at_load_naming_the_field(saved, tmp_path, field, value, phrase):
    path = write_variant(tmp_path / "bad.safetensors", saved, config={field: value})
    assert f"metadata sapiens2_config field {phrase}" in refusal(path)


def test_an_integer_of_5000_digits_is_refused_naming_the_file(saved, tmp_path):
    """json.loads refuses more than 4300 digits with a ValueError: a one-line refusal too."""
    meta = json.loads(saved[1]["sapiens2_config"])
    text = json.dumps({**meta, "depth": 0}).replace('"depth": 0', f'"depth": 1{"0" * 5000}')
    path = write_variant(tmp_path / "digits.safetensors", saved, metadata={"sapiens2_config": text})
    assert "Exceeds the limit (4300 digits)" in refusal(path)


@pytest.mark.parametrize("field, value, phrase", [
    ("out_channels", 0, "'out_channels' must be in"),
    ("upsample_channels", [2**40], "'upsample_channels' entry 0 must be in"),
    ("scale_conv_kernel_sizes", ["1", "1", "1"], "'scale_conv_kernel_sizes' entry 0 must be an integer"),
    ("flip_pairs", [[0, 7]], "'flip_pairs' names output 7 of 3"),
    ("labels", "abc", "'labels' must be a list"),
])
def test_bad_head_fields_are_refused_at_load_naming_the_field(saved, tmp_path, field, value, phrase):
    path = write_variant(tmp_path / "bad.safetensors", saved, head={field: value})
    assert f"metadata sapiens2_head_config field {phrase}" in refusal(path)


@pytest.mark.parametrize("field, value, phrase", [
    ("rms_norm_eps", float("nan"), "config.json field 'rms_norm_eps' must be finite, got nan"),
    ("num_hidden_layers", 2**63, "config.json field 'num_hidden_layers' must be in [1, 512]"),
    ("drop_path_rate", "0.1", "config.json field 'drop_path_rate' must be a number, got str"),
])
def test_bad_config_json_fields_are_refused_by_their_names_there(tmp_path, field, value, phrase):
    config = Sapiens2Config(embed_dim=32, depth=2, num_heads=2, full_attention_first=1, full_attention_last=1)
    folder = weights.save(Sapiens2(config), tmp_path / "hf", format="hf")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # as transformers writes it: no metadata of ours
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(folder / "model.safetensors"), {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    assert phrase in refusal(folder)


def test_a_scale_weight_claiming_a_huge_width_is_refused_at_once(saved, tmp_path):
    """(0, 10**12) holds no bytes, which safetensors accepts; the search for sizes that fit was linear in it."""
    path = write_variant(tmp_path / "wide.safetensors", saved, head={"scale_input_width": None},
                         tensors={"decode_head.scale_final_layer.1.weight": torch.empty(0, 10**12)})
    assert "the pointmap scale MLP takes 1000000000000 inputs: no input size gives that many" in refusal(path)


def test_a_scale_branch_that_ends_at_one_cell_is_refused_at_load(tmp_path):
    """Built at 64x48, three stride-2 convs leave 1 x 1: instance norm cannot run on it at any size that gives
    the MLP its width (64x48 and 128x96 raised torch's own ValueError at the first forward)."""
    model = tiny_pointmap(image_size=(64, 48))
    assert model.head_config.scale_input_width == 4  # 4 channels x 1 x 1
    with pytest.raises(ValueError, match="64x48 input does not fit the pointmap scale branch: this size leaves it "
                                         "a 1 x 1 map"):
        model(torch.rand(1, 3, 64, 48))
    path = weights.save(model, tmp_path / "one-cell.safetensors")
    assert "the pointmap scale MLP takes 4 inputs: no input size gives that many" in refusal(path)


def test_sizes_named_as_fitting_run(saved):
    """Every size the size check names as fitting runs (one cell was named, and failed in instance norm)."""
    model = tiny_pointmap()
    m = model.config.size_multiple
    sizes = {(hs[e] * m, ws[e] * m) for hs, ws in heads.scale_branch_fits(model.head_config) for e in (0, -1)}
    assert sizes, "the tiny model fits some sizes"
    for size in sorted(sizes, key=lambda s: s[0] * s[1])[:2]:
        assert heads.scale_branch_problem(model.head_config, size, m) is None
        model(torch.rand(1, 3, *size))


# ----------------------------------------------------------------------------------------------------
# The mutation loop: metadata fields set to nasty values, and bytes of the header edited
# ----------------------------------------------------------------------------------------------------


def mutated_checkpoint(rng, saved, path):
    """A checkpoint with one config field set to a nasty value, or with its header bytes edited."""
    if rng.random() < 0.6:
        key = rng.choice(["sapiens2_config", "sapiens2_head_config"])
        config = json.loads(saved[1][key])
        field = rng.choice(sorted(config))
        config[field] = rng.choice(NASTY_VALUES) if rng.random() < 0.8 else [rng.choice(NASTY_VALUES)] * 3
        return write_variant(path, saved, metadata={key: json.dumps(config)}), f"{key}.{field}={config[field]!r:.60}"
    write_variant(path, saved)
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    path.write_bytes(mutate(rng, data[:header]) + data[header:])
    return path, "header bytes"


def test_mutated_checkpoints_load_or_are_refused_naming_the_file(saved, tmp_path):
    """Every mutated checkpoint loads into a model whose outputs are finite, or is refused with a CheckpointError
    naming the file, in well under a second; nothing else escapes."""
    pixels = torch.rand(1, 3, 256, 192)

    def one(rng):
        path, what = mutated_checkpoint(rng, saved, tmp_path / "mutated.safetensors")
        start = time.process_time()  # (CPU time: a long run shares the machine)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. unusual rope periods: a warning, not an answer
                model = weights.load(path)
        except weights.CheckpointError as error:
            assert str(path) in str(error), what
            assert time.process_time() - start < REFUSAL_SECONDS, what
            return "refused", what
        with torch.no_grad():
            out = model(pixels)
        assert all(math.isfinite(v) for v in (out.pointmaps.sum().item(), out.scales.sum().item())), what
        return "loaded", what

    tally = fuzz_loop("checkpoints", one, count=120)
    assert not tally.failures, tally.failures[:3]
    assert tally.counts["refused"] > 0 and tally.counts["loaded"] > 0, tally.counts

