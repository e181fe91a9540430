"""The models a command runs: which checkpoint each task loads (--model), random weights instead (--random-init),
the person detector (--detector), the checks of the loaded models against the options, and what run.json says
about them. predict.py and serve.py load through load_for_tasks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sapiens2 import PRESETS, Sapiens2, heads, hub, weights
from sapiens2.processing import keypoint_metadata
from sapiens2_app.detector import detector
from sapiens2_app.common.artefacts import TASKS
from sapiens2_app.common.cli import UsageError, one_line

# --conventions: how the weights were trained (the original demos' OpenCV preprocessing, RoPE in bf16), or
# exactly what HF transformers computes (its image processor, RoPE in fp32)
CONVENTIONS = {"original": dict(resample="original", rope="bfloat16"), "transformers": dict(resample="hf", rope="float32")}
DEFAULT_SIZE = "0.4b"
RELEASED_SIZE = {"matting": "1b"}  # the only matting checkpoint is 1b
RANDOM_INIT = ("never", "fallback", "always")


@dataclass(frozen=True)
class ModelChoice:
    """--model (each value as given), --random-init, --random-backbone and the RoPE convention."""
    specs: tuple[str, ...] = ()
    random_init: str = "never"
    random_backbone: str | None = None
    rope: str = "bfloat16"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    source: str
    random: bool = False

    @property
    def backbone(self) -> Sapiens2:
        """The task model's backbone, or the model itself (a backbone, for features)."""
        return getattr(self.model, "backbone", self.model)


# ----------------------------------------------------------------------------------------------------
# Everything a run on photos loads (predict.py, serve.py)
# ----------------------------------------------------------------------------------------------------
def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """--dtype, else bf16 on GPUs that support it, else fp32."""
    if name:
        return weights.parse_dtype(name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_for_tasks(choice: ModelChoice, tasks: list[str], device, dtype, detector_source: str | None,
                   mask_with_seg: bool = False, size: tuple[int, int] | None = None, flip: bool = True
                   ) -> tuple[dict[str, LoadedModel], detector.PersonDetector | None, str | None]:
    """(one model per task, + seg when pose boxes or --mask-with-seg need it; the person detector; the --detector
    choice in effect, None without pose or with --boxes), checked against --size and the flip test before any
    image. The detector loads first: when its weights cannot be had, pose boxes come from seg, loaded next.
    `detector_source`: --detector, None when --boxes gives the boxes."""
    person_detector, boxes_from = None, None
    if "pose" in tasks and detector_source is not None:
        person_detector, boxes_from = load_detector(detector_source, choice.random_init, device, dtype)
    seg_for = "--mask-with-seg" if mask_with_seg else "pose boxes" if boxes_from == "seg" else None
    loaded = load_models(choice, tasks, device, dtype, seg_for)
    check_size_fits(size, loaded)
    check_flip_pairs(flip, loaded)
    return loaded, person_detector, boxes_from


def check_flip_pairs(flip: bool, loaded: dict[str, LoadedModel]):
    """The flip test needs the pose model's left/right pairs: say so once, before any image, not per image."""
    if flip and "pose" in loaded:
        try:
            loaded["pose"].model.flip_pairs()
        except ValueError as error:
            raise UsageError(f"--model pose: {error}; or run without the flip test (--no-flip)") from None


def check_size_fits(size: tuple[int, int] | None, loaded: dict[str, LoadedModel]):
    """--size against the loaded models, before any image: the patch grid, the pointmap scale branch."""
    if size is None:
        return
    for task, model in loaded.items():
        config = model.backbone.config
        if any(side % config.size_multiple for side in size):
            raise UsageError(f"--size {size[0]}x{size[1]}: the {task} model needs sides that are multiples of "
                             f"{config.size_multiple}")
        head = getattr(model.model, "head_config", None)
        if head is not None and (problem := heads.scale_branch_problem(head, size, config.size_multiple)):
            raise UsageError(f"--size {size[0]}x{size[1]}: {problem}")


# ----------------------------------------------------------------------------------------------------
# --model: which checkpoint each task loads
# ----------------------------------------------------------------------------------------------------
def parse_model_specs(specs) -> tuple[str | None, dict[str, str]]:
    """--model values -> (the source for every task, per-task sources). `TASK=SOURCE` picks one task; a
    task preset (`seg-1b`) names its own task; anything else (a size, a path, a hub id) is for all."""
    default, per_task = None, {}
    for spec in specs:
        task, sep, source = spec.partition("=")
        if sep and task in TASKS:
            per_task[task] = source
        elif spec in heads.TASK_PRESETS:
            per_task[spec.split("-", 1)[0]] = spec
        elif default is None:
            default = spec
        else:
            raise UsageError(f"--model {default} and --model {spec} both apply to every task; "
                             f"give one per task as TASK=SOURCE, e.g. --model seg={spec}")
    return default, per_task


def check_model_sources(specs):
    """A --model name that names nothing (`sgm-0.4b`: a bare word that is no preset, hub id or file here) is refused
    before any model loads, with the names that would do. A missing path (`x/m.safetensors`) is left to the
    loader, which names it."""
    default, per_task = parse_model_specs(specs)
    named = ([] if default is None else [(default, default)]) + [(f"{t}={s}", s) for t, s in per_task.items()]
    task_presets = ", ".join(f"{task}-{'/'.join(sizes)}" for task, sizes in heads.HEAD_TABLE.items())  # seg-0.4b/1b
    for spec, source in named:
        bare_word = Path(source).name == source and not source.endswith(".safetensors")
        if bare_word and not Path(source).exists() and not looks_like_preset_or_hub_id(source):
            raise UsageError(f"--model {spec}: no such file or folder, and not a model name; give a size "
                             f"({', '.join(PRESETS)}), a task preset ({task_presets}), a "
                             f".safetensors file, a checkpoint folder or a hub id (owner/name)")


def model_source(task: str, default: str | None, per_task: dict[str, str]) -> str:
    """The checkpoint a task loads: a preset name (-> its hub id), a hub id, a file or a folder."""
    if task in per_task:
        source = per_task[task]
    elif default is None or default in PRESETS:
        source = default or RELEASED_SIZE.get(task, DEFAULT_SIZE)
    else:
        return default
    if source in PRESETS:  # a size: the released checkpoint of this task at this size
        return source if task == "features" else f"{task}-{source}"
    return source


def load_models(choice: ModelChoice, tasks: list[str], device, dtype, seg_for: str | None = None) -> dict[str, LoadedModel]:
    """One model per task, + seg when another task needs it (`seg_for`: "--mask-with-seg", which cannot do without,
    or "pose boxes", which fall back to the whole image); a checkpoint is loaded once."""
    default, per_task = parse_model_specs(choice.specs)
    models, cache = {}, {}
    for task in tasks:
        models[task] = cached_load(cache, task, model_source(task, default, per_task), choice, device, dtype)
    if seg_for and "seg" not in tasks:
        models.update(helper_seg_model(cache, default, per_task, choice, device, dtype, seg_for))
    return models


def helper_seg_model(cache, default, per_task, choice, device, dtype, seg_for: str) -> dict[str, LoadedModel]:
    """The seg model that pose boxes / --mask-with-seg use when seg itself was not asked for. Without one,
    pose falls back to whole-image boxes (--mask-with-seg cannot do without)."""
    try:
        if default not in (None, *PRESETS) and "seg" not in per_task:
            raise UsageError("no segmentation model given (add --model seg=SOURCE)")
        return {"seg": cached_load(cache, "seg", model_source("seg", default, per_task), choice, device, dtype)}
    except UsageError as error:
        if seg_for == "--mask-with-seg":
            raise UsageError(f"--mask-with-seg needs a segmentation model: {error}") from None
        print(f"note: pose runs on the whole image, as there are no person boxes from segmentation ({error}); "
              f"--boxes gives your own", file=sys.stderr)
        return {}


def cached_load(cache: dict, task: str, source: str, choice: ModelChoice, device, dtype) -> LoadedModel:
    """Features reuse the backbone of any model loaded from the same source; a task model serves its task."""
    loaded = cache.get(source)
    fits = loaded is not None and (task == "features" or getattr(loaded.model, "task", None) == task)
    if not fits:
        loaded = cache[source] = load_one(task, source, choice, device, dtype)
    if task == "features":
        return LoadedModel(loaded.backbone, source, loaded.random)
    return loaded


def load_one(task: str, source: str, choice: ModelChoice, device, dtype) -> LoadedModel:
    def checkpoint():
        if source in heads.TASK_PRESETS and source not in hub.HUB_IDS:
            raise FileNotFoundError(f"{source}: no released checkpoint; pass a file with --model {task}=PATH")
        return weights.load(source, dtype=dtype, device=device, task=None if task == "features" else task,
                            rope_dtype=choice.rope)

    def random_weights():
        """The real architecture (heads.random_model), the same weights in every process (sharded runs agree)."""
        model = heads.random_model(task, source, choice.random_backbone, seed=TASKS.index(task), rope_dtype=choice.rope)
        return model.to(device, dtype).eval()

    try:
        model, random = load_or_random(source, choice.random_init, checkpoint, random_weights)
    except weights.CheckpointError as error:  # present but unusable: never a random fallback
        raise UsageError(f"--model {task}={source}: cannot use it: {one_line(str(error))}") from None
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    return LoadedModel(model, source, random)


# ----------------------------------------------------------------------------------------------------
# --random-init: random weights instead of a checkpoint (predict.py, train.py, export.py; the models come
# from heads.random_model)
# ----------------------------------------------------------------------------------------------------
def looks_like_preset_or_hub_id(source: str) -> bool:
    """Only downloads fall back to random weights; a mistyped local path stays an error."""
    return source in PRESETS or source in heads.TASK_PRESETS or (
        bool(hub.HUB_ID.match(source)) and not Path(source).exists() and not source.endswith(".safetensors"))


def load_or_random(source: str, random_init: str, load_checkpoint, random_weights, note=None):
    """(model, whether its weights are random), as --random-init says: "never" loads (load_checkpoint()),
    "always" does not try (random_weights()), "fallback" loads and takes random weights when a download (a
    preset name or hub id) cannot be had, saying why through `note` (default: stderr). A missing local file
    (FileNotFoundError) and a checkpoint that is there but unusable (CheckpointError) stay errors."""
    if random_init not in RANDOM_INIT:
        raise ValueError(f"random_init must be one of {', '.join(RANDOM_INIT)}, got {random_init!r}")
    if random_init == "always":
        return random_weights(), True
    try:
        return load_checkpoint(), False
    except FileNotFoundError as error:
        if random_init != "fallback" or not looks_like_preset_or_hub_id(str(source)):
            raise
        (note or (lambda message: print(message, file=sys.stderr)))(f"cannot load {source}: {error}")
        return random_weights(), True


def random_banner(loaded: dict[str, LoadedModel], random_init: str, detector: str | None) -> str:
    """The loud warning of a run with random weights; `detector`: where pose boxes come from (None: --boxes)."""
    tasks = ", ".join(t for t, m in loaded.items() if m.random)
    pose_boxes = []
    if random_init == "always" and "pose" in loaded and detector is not None:
        pose_boxes = ["Pose boxes: " + ("the random segmentation's blobs (--detector seg)." if detector == "seg"
                                        else "the whole image (no person detector was loaded).")]
    return random_weights_banner(
        tasks, random_init, "The outputs show that the pipeline runs end to end; the pictures are MEANINGLESS.",
        *pose_boxes)


def random_weights_banner(tasks: str, random_init: str, consequence: str, *more: str) -> str:
    """The loud warning of a run on random weights, printed before and after it: why the weights are random
    (--random-init always, or a download that failed), `consequence` (what that means for this command's
    outputs) and `more` lines."""
    if random_init == "always":
        why = "--random-init always, no checkpoint was loaded or downloaded."
        advice = "For real results run without --random-init always."
    else:
        why = "their checkpoints could not be loaded (see the message above)."
        advice = "For real results download the weights (see the message above) and run again."
    bar = "!" * 78
    lines = [f"RANDOM WEIGHTS for {tasks}: {why}", consequence, *more, advice]
    return f"\n{bar}\n" + "".join(f"!!  {line}\n" for line in lines) + f"{bar}\n"


# ----------------------------------------------------------------------------------------------------
# The person detector
# ----------------------------------------------------------------------------------------------------
def load_detector(source: str, random_init: str, device, dtype) -> tuple[detector.PersonDetector | None, str]:
    """(the person detector for pose boxes, the --detector choice in effect): `source` ('seg' and 'none' load
    nothing). When its weights cannot be downloaded, say so and use the segmentation's blobs ('seg'); a missing
    local file stays an error. With --random-init always nothing is loaded or downloaded: 'none', the whole image."""
    if source in ("seg", "none"):
        return None, source
    if random_init == "always":
        return None, "none"
    try:
        return detector.load(source, dtype=dtype, device=device), source
    except FileNotFoundError as error:
        if not detector.is_hub_id(source):
            raise UsageError(f"--detector: {error}") from None
        print(f"note: no person detector ({error}); pose boxes come from the segmentation's person blobs "
              f"instead (--detector seg)", file=sys.stderr)
        return None, "seg"
    except ValueError as error:
        raise UsageError(f"--detector: {error}") from None


# ----------------------------------------------------------------------------------------------------
# What a model is, for run.json and the outputs
# ----------------------------------------------------------------------------------------------------
def describe_model(loaded: LoadedModel, dtype: str) -> dict:
    model = loaded.model
    head = model.head_config.to_dict() if isinstance(model, heads.Sapiens2ForTask) else None
    return {"source": loaded.source, "random_weights": loaded.random, "dtype": dtype,
            "backbone": loaded.backbone.config.to_dict(), "head": head,
            "parameters": sum(p.numel() for p in model.parameters())}


def features_model(loaded: LoadedModel) -> str:
    """What made a features file: the checkpoint, or the random backbone that stood in for it (--random-init)."""
    if not loaded.random:
        return loaded.source
    config = loaded.backbone.config
    shape = lambda c: (c.embed_dim, c.depth, c.use_tokenizer)  # noqa: E731
    size = next((name for name, preset in PRESETS.items() if shape(preset) == shape(config)),
                f"{config.embed_dim}-wide {config.depth}-block")  # random models come from a preset: by its name
    return f"random weights, {size} backbone (--random-init, in place of {loaded.source})"


def keypoint_names(model) -> tuple[str, ...]:
    """A pose model's keypoint names: its own (train.py, id2label), else the 308's (a 308-channel model),
    else keypoint_0, keypoint_1, ... (a checkpoint without names)."""
    config = model.head_config
    if config.labels is not None:
        return tuple(config.labels)
    names308 = keypoint_metadata()["keypoint_names"]
    return tuple(names308) if config.out_channels == len(names308) else tuple(
        f"keypoint_{k}" for k in range(config.out_channels))
