"""train.py's recipe as the original training configs give it, per task and size: the table against the values
extracted from the 21 configs, the schedule against the original's (torch's LinearLR + PolynomialLR), the parameter
groups against the original's layer-wise decay constructor, the new-head init, the recipe printed and logged with
its sources; and every numeric option of train.py refused out of its range, up front."""

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from sapiens2 import heads
import train
from sapiens2 import PRESETS, Sapiens2Config, layer_decay_groups
from sapiens2_app.train import optimization, starting_model
from test_train import HEADS, make_dataset, read_log, tiny_backbone

FIXTURE = Path(__file__).parent / "fixtures" / "recipe" / "original_configs.json"  # make_recipe_fixture.py


@pytest.fixture(scope="module")
def configs() -> list[dict]:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def backbone(tmp_path_factory) -> Path:
    return tiny_backbone(tmp_path_factory.mktemp("backbone"))


def parsed(*options: str):
    return train.build_parser().parse_args(["seg", "--data", "d", "-o", "o", *options])


# ----------------------------------------------------------------------------------------------------
# The table, against the configs
# ----------------------------------------------------------------------------------------------------
def test_released_recipes_are_the_configs(configs):
    assert len(configs) == 21  # 4 sizes x 5 tasks in facebookresearch/sapiens2, and the matting 1b of e07a5f8
    assert {(c["task"], c["size"]) for c in configs} == set(optimization.RELEASED_RECIPES)
    for c in configs:
        precision = "bf16" if c["mixed_precision"] == "bf16" else "fp32"  # absent: accelerate's default, "no"
        expected = (c["lr"], c["layer_decay_rate"], c["clip_grad"]["max_norm"], precision)
        assert tuple(optimization.RELEASED_RECIPES[c["task"], c["size"]]) == expected, c["config"]


def test_what_every_config_shares(configs):
    """The constants of optimization.py, and what the recipe's formulas take for granted."""
    for c in configs:
        preset = PRESETS[c["size"]]
        assert (c["embed_dim"], c["num_layers"], c["paramwise_num_layers"]) == (preset.embed_dim, preset.depth,
                                                                                preset.depth), c["config"]
        assert c["optimizer"] == "AdamW" and tuple(c["betas"]) == optimization.BETAS
        assert c["weight_decay"] == optimization.WEIGHT_DECAY
        assert c["clip_grad"]["mode"] == "norm" and c["clip_grad"]["norm_type"] == 2.0
        assert c["gradient_accumulation_steps"] == 1
        warmup, total = c["warmup_iters"], c["num_iters"]
        assert warmup == optimization.WARMUP_STEPS and total >= warmup / optimization.SHORT_RUN_WARMUP
        assert c["scheduler"] == {"type": "SequentialLR", "milestones": [warmup], "schedulers": [
            {"type": "LinearLR", "start_factor": optimization.WARMUP_START_FACTOR, "total_iters": warmup},
            {"type": "PolynomialLR", "total_iters": total - warmup, "power": 1.0}]}, c["config"]


def test_the_docs_table_is_the_recipe():
    """docs/training.md's table of the recipe says what RELEASED_RECIPES holds."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    section = text[text.index("\n## The recipe"):text.index("\n## Options")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| lr")]
    sizes = ["0.4b", "0.8b", "1b", "5b"]
    documented = {(row[0], size): cell for row in rows for size, cell in zip(sizes, row[1:], strict=True)
                  if cell != "(normal's)"}
    assert documented == {key: f"{optimization.short_number(r.lr)}, {r.layer_decay:g}, {r.clip_grad:g}, {r.precision}"
                          for key, r in optimization.RELEASED_RECIPES.items()}


# ----------------------------------------------------------------------------------------------------
# The defaults a run takes
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task, config, device, expected, source", [
    ("seg", PRESETS["0.4b"], "cuda", (5e-4, 0.8, 2.0, "bf16"), "seg 0.4b config"),
    ("seg", PRESETS["0.8b"], "cuda", (5e-4, 0.85, 4.0, "fp32"), "seg 0.8b config"),
    ("pose", PRESETS["5b"], "cuda", (1e-4, 0.94, 4.0, "bf16"), "pose 5b config"),
    ("pointmap", PRESETS["0.8b"], "cuda", (5e-4, 0.85, 2.0, "fp32"), "pointmap 0.8b config"),
    ("albedo", PRESETS["5b"], "cuda", (5e-4, 0.94, 4.0, "bf16"), "albedo 5b config"),
    ("normal", PRESETS["1b-4k"], "cuda", (5e-4, 0.9, 4.0, "bf16"), "normal 1b config"),
    ("pose", PRESETS["0.1b"], "cuda", (5e-4, 0.8, 2.0, "bf16"), "pose 0.4b config"),  # nearest released size
    ("seg", Sapiens2Config(1400, 4, 14), "cuda", (5e-4, 0.85, 4.0, "fp32"), "seg 0.8b config"),  # 120 from 0.8b
    ("matting", PRESETS["1b"], "cuda", (5e-4, 0.9, 4.0, "bf16"), "matting 1b config"),
    ("matting", PRESETS["0.4b"], "cuda", (5e-4, 0.8, 2.0, "bf16"), "normal 0.4b config"),
    ("seg", PRESETS["0.4b"], "cpu", (5e-4, 0.8, 2.0, "fp32"), "seg 0.4b config"),  # no bf16 autocast on a CPU
])
def test_defaults_follow_the_config_of_the_task_and_size(task, config, device, expected, source):
    args = train.build_parser().parse_args([task, "--data", "d", "-o", "o"])
    settings = optimization.resolve_recipe(args, config, device, 20000, given=set())
    assert (args.lr, args.layer_decay, args.clip_grad, args.precision) == expected
    assert (settings["warmup"].value, args.schedule, args.weight_decay) == (500, "linear", 0.1)
    # set on args, for the checkpoints to keep: all but the default warmup (it follows --steps, which a resume
    # may change)
    assert {name: s.value for name, s in settings.items() if name != "warmup"} == {
        name: getattr(args, name) for name in optimization.RECIPE_OPTIONS if name != "warmup"}
    assert args.warmup is None
    assert settings["lr"].source == source and settings["layer_decay"].source == source
    assert (device == "cpu") == settings["precision"].source.startswith("on cpu")


def test_a_given_option_wins_and_says_so():
    args = parsed("--lr", "3e-4", "--layer-decay", "1", "--clip-grad", "0", "--warmup", "7", "--schedule",
                  "cosine", "--precision", "fp32", "--weight-decay", "0.05")
    given = train.explicit_options(train.build_parser(), ["--lr", "3e-4"])
    settings = optimization.resolve_recipe(args, PRESETS["0.4b"], "cuda", 100, given=None)
    assert {n: (s.value, s.source) for n, s in settings.items()} == {
        "lr": (3e-4, "--lr"), "layer_decay": (1.0, "--layer-decay"), "clip_grad": (0.0, "--clip-grad"),
        "warmup": (7, "--warmup"), "schedule": ("cosine", "--schedule"), "precision": ("fp32", "--precision"),
        "weight_decay": (0.05, "--weight-decay")}
    assert given == {"lr"}
    short = optimization.resolve_recipe(parsed(), PRESETS["0.4b"], "cuda", 100, given=set())
    assert short["warmup"].value == 5 and "at most 5% of 100 steps" in short["warmup"].source


def test_train_prints_logs_and_resumes_the_recipe(backbone, tmp_path, capsys):
    """The run reports each value and its source, logs them in log.jsonl, trains with them (the lr of each step),
    and a resumed run goes on with the same values, from the run."""
    data = make_dataset("seg", tmp_path / "data")
    out = tmp_path / "run"
    common = ["seg", "--data", data, "-o", out, "--head", HEADS["seg"], "--workers", 0, "--no-progress",
              "--no-augment", "--steps", 4, "--log-every", 1]
    assert train.main([str(a) for a in [*common, "--model", backbone, "--lr", "3e-4", "--stop-at", 2]]) == 0
    err = capsys.readouterr().err
    assert "recipe, following the seg 0.4b config (0.4b is the released size nearest to embed_dim 32)" in err
    assert "lr 3e-4 (--lr), layer decay 0.8 (seg 0.4b config)" in err and "gradient-norm clip 2 (seg 0.4b" in err
    assert train.main([str(a) for a in [*common, "--resume"]]) == 0
    log = read_log(out)
    first, second = [r for r in log if "start" in r]
    assert first["recipe"]["lr"] == {"value": 3e-4, "from": "--lr"}
    assert first["recipe"]["layer_decay"] == {"value": 0.8, "from": "seg 0.4b config"}
    assert first["recipe"]["clip_grad"] == {"value": 2.0, "from": "seg 0.4b config"}
    assert first["recipe"]["warmup"]["value"] == 0  # 5% of 4 steps
    assert second["recipe"]["lr"] == {"value": 3e-4, "from": "the resumed run"}
    assert {k: v["value"] for k, v in second["recipe"].items()} == {k: v["value"] for k, v in first["recipe"].items()}
    lrs = [r["lr"] for r in log if "lr" in r and "step" in r]
    assert lrs == pytest.approx([original_lr(i, 3e-4, 0, 4) for i in range(4)], rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# The schedule, against the original's
# ----------------------------------------------------------------------------------------------------
def original_lr(i: int, base: float, warmup: int, num_iters: int, start_factor: float = 1e-3) -> float:
    """The lr of iteration i (0-based) in the original configs' scheduler (e.g.
    sapiens/dense/configs/seg/shutterstock_goliath/sapiens2_0.4b_seg_shutterstock_goliath-1024x768.py, `scheduler`):
    SequentialLR(milestones=[warmup]) of LinearLR(start_factor, total_iters=warmup) and
    PolynomialLR(total_iters=num_iters - warmup, power=1.0), stepped after each optimizer step
    (sapiens/engine/runners/base_runner.py, train)."""
    if i < warmup:
        return base * (start_factor + (1 - start_factor) * i / warmup)
    return base * (1 - (i - warmup) / (num_iters - warmup))


def torch_sequential_lrs(base: float, warmup: int, num_iters: int) -> list[float]:
    """The lrs the original's scheduler gives, built from torch's classes as sapiens/engine/optim/lr_scheduler.py
    registers them."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    schedulers = [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-3, total_iters=warmup),
                  torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=num_iters - warmup, power=1.0)]
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones=[warmup])
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scheduler.step() without optimizer.step(): only the lr is wanted
        for _ in range(num_iters):
            lrs.append(optimizer.param_groups[0]["lr"])
            scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup, total", [(500, 10000), (5, 20), (1, 3)])
def test_schedule_is_the_originals(warmup, total):
    ours = [optimization.learning_rate(i, total, warmup, 5e-4, 0.0) for i in range(total)]
    # the closed form against torch's chained form (a product of per-step factors): float64 rounding, ~1e-16 per
    # step, so a relative 1e-9 holds over these 10000 steps with room to spare
    assert ours == pytest.approx([original_lr(i, 5e-4, warmup, total) for i in range(total)], rel=1e-12)
    assert ours == pytest.approx(torch_sequential_lrs(5e-4, warmup, total), rel=1e-9)
    assert ours[0] == pytest.approx(5e-4 * 1e-3) and ours[-1] == pytest.approx(5e-4 / (total - warmup))


def test_cosine_and_floor_on_request():
    lr = [optimization.learning_rate(i, 10, 2, 1.0, 0.1, "cosine") for i in (0, 1, 2, 6, 10)]
    assert lr == pytest.approx([1e-3, 1e-3 + 0.999 / 2, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), 0.1])
    assert optimization.learning_rate(6, 10, 2, 1.0, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)  # linear to the floor


# ----------------------------------------------------------------------------------------------------
# Parameter groups, against the original's layer-wise decay constructor
# ----------------------------------------------------------------------------------------------------
def original_layer_id(var_name: str, num_max_layer: int) -> int:
    """sapiens/engine/runners/base_runner.py:607 _get_layer_id_for_sapiens (the fsdp prefix aside)."""
    if var_name in ("backbone.cls_token", "backbone.mask_token", "backbone.pos_embed", "backbone.storage_tokens"):
        return 0
    elif var_name.startswith("backbone.patch_embed"):
        return 0
    elif var_name.startswith("backbone.tokenizer"):
        return 0
    elif var_name.startswith("backbone.layers") or var_name.startswith("backbone.blocks"):
        try:
            return int(var_name.split(".")[2]) + 1
        except (ValueError, IndexError):
            return num_max_layer - 1
    else:
        return num_max_layer - 1


def original_groups(model, lr: float, weight_decay: float, layer_decay_rate: float, num_layers: int) -> dict:
    """sapiens/engine/runners/base_runner.py:638 _generate_param_groups: {name: (lr, weight decay)}."""
    num_layers = num_layers + 2
    result = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if len(param.shape) == 1 or name.endswith(".bias") or "pos_embed" in name:
            this_weight_decay = 0.0
        else:
            this_weight_decay = weight_decay
        layer_id = original_layer_id(name, num_layers)
        lr_scale = layer_decay_rate ** (num_layers - layer_id - 1)
        result[name] = (lr * lr_scale, this_weight_decay)
    return result


@pytest.mark.parametrize("task", ["pointmap", "pose"])
def test_parameter_groups_are_the_originals(task):
    """Every parameter's lr and weight decay, on a backbone with a tokenizer (its pos_embed) and a mask token,
    under a pointmap head (linear layers) and a pose head, with a frozen block."""
    config = Sapiens2Config(32, 3, 2, full_attention_first=1, full_attention_last=1, use_tokenizer=True,
                            tokenizer_layers=1, use_mask_token=True, image_size=(256, 192))
    with torch.device("meta"):
        model = heads.build_task_model(config, heads.default_head(task, config, 3 if task == "pointmap" else 5))
    model.backbone.blocks[0].requires_grad_(False)
    names = [n for n, _ in model.named_parameters()]
    assert any("pos_embed" in n for n in names) and "backbone.mask_token" in names
    groups = layer_decay_groups(model, lr=2e-4, weight_decay=0.1, layer_decay=0.8)  # the library's, as train.py's
    ours = {id(p): (g["lr"] * g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}
    expected = original_groups(model, 2e-4, 0.1, 0.8, config.depth)
    by_name = {n: ours[id(p)] for n, p in model.named_parameters() if id(p) in ours}
    assert by_name.keys() == expected.keys() and not any(n.startswith("backbone.blocks.0.") for n in by_name)
    # the same float expression (base x rate ** k) on both sides: equal to the bit
    assert {n: v for n, v in by_name.items() if v != expected[n]} == {}
    assert by_name["backbone.cls_token"] == (2e-4 * 0.8**4, 0.1)  # decayed, as there


# ----------------------------------------------------------------------------------------------------
# The new head's init
# ----------------------------------------------------------------------------------------------------
def std_close(weight: torch.Tensor, std: float) -> bool:
    """The sample std within 6 standard errors of `std` (normal samples: relative s.e. 1 / sqrt(2n))."""
    return abs(weight.std().item() / std - 1) < 6 / math.sqrt(2 * weight.numel())


@pytest.mark.parametrize("task", ["seg", "pose", "pointmap"])
def test_a_new_head_starts_as_the_originals(task, backbone):
    """Conv2d kaiming-normal (fan_out, relu), Linear kaiming-normal (fan_in, linear), biases zero; seg's transposed
    convolutions keep PyTorch's default (kaiming-uniform, a = sqrt(5)), pose's are kaiming-normal too."""
    widths = {"seg": "64,64,64,64:64,64", "pose": "64,64:64,64", "pointmap": "64,64,64,64:64,64:64:64,64"}[task]
    args = train.build_parser().parse_args([task, "--data", "d", "-o", "o", "--model", str(backbone), "--head",
                                            widths])
    model, _ = starting_model.build_model(args, {"out_channels": 3, "keypoint_names": list("abc"),
                                                 "flip_pairs": [], "class_names": list("abc")}, log=print)
    checked = set()
    for name, module in model.decode_head.named_modules():
        if not isinstance(module, (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.Linear)):
            continue
        weight = module.weight.detach()
        fan_in, fan_out = torch.nn.init._calculate_fan_in_and_fan_out(weight)
        if module.bias is not None:
            assert not module.bias.any(), name
        if isinstance(module, torch.nn.ConvTranspose2d) and task != "pose":
            bound = 1 / math.sqrt(fan_in)
            assert weight.abs().max() <= bound and std_close(weight, bound / math.sqrt(3)), name
        elif isinstance(module, torch.nn.Linear):
            assert weight.numel() < 1000 or std_close(weight, math.sqrt(1 / fan_in)), name
        else:
            assert weight.numel() < 1000 or std_close(weight, math.sqrt(2 / fan_out)), name
        checked.add(type(module).__name__ if weight.numel() >= 1000 else "small")
    assert {"Conv2d", "ConvTranspose2d" if task != "pointmap" else "Linear"} <= checked


# ----------------------------------------------------------------------------------------------------
# Option values: refused by the parser, naming the option and its range, before anything loads
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option, value, says", [
    ("--lr", "-1e-4", "expected a number > 0"),
    ("--lr", "nan", "expected a number > 0"),
    ("--lr", "inf", "expected a number > 0"),
    ("--lr", "0", "expected a number > 0"),
    ("--min-lr", "-1e-6", "expected a number >= 0"),
    ("--batch-size", "0", "expected a whole number >= 1"),
    ("--accumulate", "0", "expected a whole number >= 1"),
    ("--steps", "0", "expected a whole number >= 1"),
    ("--steps", "-5", "expected a whole number >= 1"),
    ("--steps", "2.5", "expected a whole number >= 1"),
    ("--epochs", "0", "expected a number > 0"),
    ("--epochs", "nan", "expected a number > 0"),
    ("--stop-at", "0", "expected a whole number >= 1"),
    ("--layer-decay", "8.5", "expected a number > 0 and <= 1"),
    ("--layer-decay", "0", "expected a number > 0 and <= 1"),
    ("--warmup", "-1", "expected a whole number >= 0"),
    ("--clip-grad", "-1", "expected a number >= 0"),
    ("--clip-grad", "nan", "expected a number >= 0"),
    ("--weight-decay", "-0.1", "expected a number >= 0"),
    ("--save-every", "-1", "expected a whole number >= 0"),
    ("--eval-every", "-1", "expected a whole number >= 0"),
    ("--log-every", "0", "expected a whole number >= 1"),
    ("--workers", "-1", "expected a whole number >= 0"),
    ("--seed", "-1", "expected a whole number >= 0 and <= 4294967295"),
    ("--seed", str(2**32), "expected a whole number >= 0 and <= 4294967295"),
])
def test_an_option_out_of_its_range_is_refused_up_front(option, value, says, tmp_path, capsys):
    """--model names no file: had the parser let the value through, the error would be about --model."""
    argv = ["seg", "--data", str(tmp_path), "-o", str(tmp_path / "out"), "--model", str(tmp_path / "none.st"),
            f"{option}={value}"]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: argument {option}: {says}, got '{value}'"), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, says", [
    (["--warmup", "10", "--steps", "5"], "--warmup 10 is not shorter than the run (5 steps)"),
    (["--min-lr", "1e-3", "--lr", "1e-4"], "--min-lr 0.001 is not below the peak lr 0.0001"),
])
def test_a_schedule_that_cannot_be_is_refused_up_front(options, says, tmp_path, capsys):
    argv = ["seg", "--data", str(tmp_path), "-o", str(tmp_path / "out"), "--model", str(tmp_path / "none.st"),
            *options]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {says}"), err


def test_the_edges_of_the_ranges_are_accepted():
    args = parsed("--layer-decay", "1", "--clip-grad", "0", "--warmup", "0", "--workers", "0", "--seed", "0",
                  "--save-every", "0", "--eval-every", "0", "--min-lr", "0", "--steps", "1", "--epochs", "0.5",
                  "--seed", str(2**32 - 1))
    assert (args.layer_decay, args.clip_grad, args.warmup, args.steps, args.seed) == (1.0, 0.0, 0, 1, 2**32 - 1)
