"""A training run's checkpoint in OUT/, without pickle: model.safetensors + config.json (what weights.load reads),
optimizer.safetensors (AdamW moments, every process's RNG states) and train_state.json (the step, the options,
the parameter groups), written together; and reading them back for --resume, bit for bit."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from sapiens2 import heads, weights
from sapiens2_app.common import safe_io
from sapiens2_app.common.cli import UsageError, not_held
from sapiens2_app.train.distributed import Distributed, fsdp2, unwrapped

STATE_FILE, OPTIMIZER_FILE = "train_state.json", "optimizer.safetensors"
STAGING_PREFIX = ".checkpoint."  # + the writer's pid + "." (staging folders: .checkpoint.PID.RANDOM.tmp)
STAGING = re.compile(r"^\.checkpoint\.(?:(\d+)\.)?.*\.tmp$")  # (older versions wrote no pid)


class TrainingStopped(Exception):
    """A run that cannot go on (a checkpoint that cannot be written, a loss or weights no longer finite): one
    `error:` line saying why and which checkpoint OUT keeps; exit status 1."""


def stored(value):
    """A parsed option's value as train_state.json holds it (JSON: tuples are lists)."""
    return json.loads(json.dumps(value))


def read_state(out: Path) -> dict:
    """OUT/train_state.json: the step, the global batch, the options (`args`), the dataset's `info`, ...; a file that
    is not one (hand-edited, another program's) is a UsageError naming it."""
    path = Path(out) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"{path}: cannot read it as a training state ({error}); it is written by train.py "
                         "with each checkpoint: restore it, or start a new run with --model " + str(out)) from None
    expected = {"step": int, "global_batch": int, "args": dict, "param_groups": list, "info": dict}
    wrong = [key for key, kind in expected.items()
             if not isinstance(state, dict) or not isinstance(state.get(key), kind)]
    if wrong:
        raise UsageError(f"{path}: not a training state of train.py ({', '.join(wrong)} missing or of the wrong "
                         f"type); restore it, or start a new run with --model {out}")
    return state


def check_same_outputs(out: Path, saved_info: dict, info: dict, task: str, data: Path):
    """--resume with --data whose classes (seg) or keypoints (pose) are not the run's: a UsageError saying what
    differs (the head has one output per class or keypoint, and the names are stored with the model)."""
    labelled = {"seg": ("class_names", "classes", data / "classes.json"),
                "pose": ("keypoint_names", "keypoints", data / "train" / "annotations.json")}
    key, what, source = labelled.get(task, (None, None, None))
    if key is None or saved_info.get(key) == info[key]:
        return
    old, new = saved_info.get(key) or [], info[key]
    if len(old) != len(new):
        differs = f"{len(old)} {what} ({shortened(old)}), {source} lists {len(new)} ({shortened(new)})"
    else:
        i = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
        differs = f"{len(old)} {what}, but {what} {i} is {old[i]!r} there and {new[i]!r} in {source}"
    raise UsageError(f"--resume: the run in {out} was trained on {differs}; resume it with its own data, or start "
                     f"a new run from its weights with --model {out}")


def shortened(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def kept_checkpoint(out: Path) -> str:
    """What OUT holds now, for the line of a run that stopped."""
    try:
        return f"{out} keeps the checkpoint of step {read_state(out)['step']} (--resume continues from it)"
    except UsageError:
        return f"no checkpoint was saved in {out}"


def remove_stale_temporaries(out: Path) -> list[str]:
    """What a killed run (kill -9, power loss) left in OUT: its checkpoint staging folders (a whole model each) and
    atomic_write's temporaries (the writability probe's), those whose writer process no longer runs here, whatever
    their age (--resume continues the run in OUT: no other run may write there). Returns their names."""
    removed = []
    for item in sorted(Path(out).iterdir()):
        staging, temporary = STAGING.match(item.name), safe_io.TEMPORARY.match(item.name)
        match = staging if staging and item.is_dir() else temporary if temporary and item.is_file() else None
        if match is None or (match[1] and safe_io.process_alive(int(match[1]))):
            continue
        shutil.rmtree(item, ignore_errors=True) if item.is_dir() else item.unlink(missing_ok=True)
        removed.append(item.name)
    return removed


def state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(out: Path, model, optimizer, step: int, args, info: dict, dist_info: Distributed, global_batch: int,
                    held=not_held):
    """The checkpoint of `step` in OUT: every process takes part (the full state of FSDP shards, every process's
    RNG state); the main process writes it. Non-finite weights or optimizer moments are never saved, and a write
    that fails (a full disk) leaves the previous checkpoint as it was: both raise TrainingStopped on every process."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model, options=state_dict_options())
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=state_dict_options())
    rng = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(dist_info.device)] if dist_info.device.type == "cuda" else [])
    rng = dist_info.gather(rng)
    problem = None
    if dist_info.main:  # (with FSDP and cpu_offload only the main process holds the full state)
        bad = non_finite(model_state, optimizer_state)
        if bad:
            problem = (f"the weights of step {step} hold NaN or Inf ({bad}): the training diverged (a lower --lr, "
                       "or --clip-grad, may help); not saved")
        else:
            problem = written_or_why(out, unwrapped(model), model_state, optimizer_state, rng, step, args, info,
                                     global_batch, held)
    if dist_info.any(problem is not None):
        raise TrainingStopped(f"{problem or f'the main process could not save step {step}'}; {kept_checkpoint(out)}")
    dist_info.barrier()


def non_finite(model_state: dict, optimizer_state: dict) -> str:
    """The tensors of the weights or the AdamW moments that hold NaN or Inf ('' when none do)."""
    tensors = {**model_state, **{f"optimizer {name}.{key}": value for name, entries in optimizer_state["state"].items()
                                 for key, value in entries.items()}}
    # a sum is finite only if every element is (one pass, no temporary); an overflowing sum gets the exact test
    bad = [name for name, t in tensors.items() if torch.is_tensor(t) and t.is_floating_point()
           and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all())]
    return f"{len(bad)} tensors: {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}" if bad else ""


def written_or_why(out: Path, model, model_state, optimizer_state, rng, step, *rest) -> str | None:
    """write_checkpoint; None when written, else the reason (a full disk, a read-only OUT)."""
    try:
        write_checkpoint(out, model, model_state, optimizer_state, rng, step, *rest)
        return None
    except OSError as error:
        text = safe_io.os_error_text(error)
    except SafetensorError as error:  # safetensors writes its files itself: its I/O errors carry the OS's code
        code = re.search(r"\(os error (\d+)\)", str(error))
        text = safe_io.os_error_text(OSError(int(code[1]), os.strerror(int(code[1])))) if code else str(error)
    return f"cannot save the checkpoint of step {step} in {out} ({text})"


def write_checkpoint(out: Path, model, model_state, optimizer_state, rng, step, args, info, global_batch,
                     held=not_held):
    """Every file is written into a fresh staging folder first and moved into OUT only when all are written;
    train_state.json, moved last, names the step. The staging folder's name holds the writer's pid, so that a
    --resume after a kill -9 knows it is stale (remove_stale_temporaries); a second Ctrl-C does not cut the moves."""
    with held() as hold_from_here, safe_io.staging_folder(out, prefix=f"{STAGING_PREFIX}{os.getpid()}.",
                                                          last=(STATE_FILE,)) as tmp:
        write_checkpoint_files(tmp, model, model_state, optimizer_state, rng, step, args, info, global_batch)
        hold_from_here()  # the moves into OUT (the staging folder's exit)


def write_checkpoint_files(tmp: Path, model, model_state, optimizer_state, rng, step, args, info, global_batch):
    with torch.device("meta"):
        plain = heads.build_task_model(model.config, model.head_config)
    plain.load_state_dict({k: v.float() for k, v in model_state.items()}, assign=True)
    weights.save(plain, tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["sapiens2_training"] = {"task": args.task, "step": step, **{k: v for k, v in info.items() if k != "out_channels"}}
    (tmp / "config.json").write_text(safe_io.json_text(config, indent=2))
    tensors, groups = {}, []
    for name, entries in optimizer_state["state"].items():
        for key, value in entries.items():
            tensors[f"state/{name}/{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    for group in optimizer_state["param_groups"]:
        groups.append({k: v for k, v in group.items()})
    for r, states in enumerate(rng):
        for i, state in enumerate(states):
            tensors[f"rng/{r}/{i}"] = state.cpu()
    weights.save_safetensors(tensors, tmp / OPTIMIZER_FILE, {"step": str(step)})
    state = {"step": step, "global_batch": global_batch, "args": {k: stored(v) for k, v in vars(args).items()},
             "param_groups": groups, "info": info, "torch": torch.__version__}
    (tmp / STATE_FILE).write_text(safe_io.json_text(state, indent=2))


def load_training_state(out: Path, model, optimizer, dist_info: Distributed) -> int:
    """--resume: the optimizer state and this process's RNG states from OUT (the model was loaded from it);
    returns the step the run continues from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = read_state(out)
    step = state["step"]
    # FSDP: only rank 0 reads the full optimizer state; the others receive their shards from it.
    broadcast = isinstance(model, fsdp2()[1]) and dist_info.world > 1
    try:
        with safe_open(str(out / OPTIMIZER_FILE), "pt") as f:
            wanted = [k for k in f.keys() if dist_info.main or not broadcast or k.startswith("rng/")]
            tensors = {k: weights.aligned(f.get_tensor(k)) for k in wanted}  # as the uninterrupted run's
    except (OSError, SafetensorError) as error:
        raise UsageError(f"{out / OPTIMIZER_FILE}: cannot read the optimizer state ({error}); without it the run "
                         f"cannot continue exactly: start a new one with --model {out}") from None
    saved_step = json.loads((out / "config.json").read_text()).get("sapiens2_training", {}).get("step")
    if saved_step != step:
        raise UsageError(f"{out}: model.safetensors is from step {saved_step}, {STATE_FILE} from step {step} (a save "
                         f"was interrupted): the run cannot continue exactly; start a new one with --model {out}")
    entries = {}
    for key, value in tensors.items():
        if key.startswith("state/"):
            _, rest = key.split("/", 1)
            name, field = rest.rsplit("/", 1)
            entries.setdefault(name, {})[field] = value
    optimizer_state = {"state": entries, "param_groups": state["param_groups"]}
    if broadcast and not dist_info.main:
        optimizer_state = {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state, options=options)
    rank = dist_info.rank if f"rng/{dist_info.rank}/0" in tensors else 0
    torch.set_rng_state(tensors[f"rng/{rank}/0"])
    if dist_info.device.type == "cuda" and f"rng/{rank}/1" in tensors:
        torch.cuda.set_rng_state(tensors[f"rng/{rank}/1"], dist_info.device)
    return step
