"""A training run's checkpoint in OUT/, without pickle: model.safetensors + config.json (what weights.load reads),
optimizer.safetensors (AdamW moments, every process's RNG states) and train_state.json (the step, the options,
the parameter groups), written together; and reading them back for --resume, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

import heads
import weights
from sapiens2_app import safe_io
from sapiens2_app.cli import UsageError
from sapiens2_app.distributed import Distributed, fsdp2, unwrapped

STATE_FILE, OPTIMIZER_FILE = "train_state.json", "optimizer.safetensors"


def stored(value):
    """A parsed option's value as train_state.json holds it (JSON: tuples are lists)."""
    return json.loads(json.dumps(value))


def read_state(out: Path) -> dict:
    """OUT/train_state.json: the step, the global batch, the options (`args`), the dataset's `info`, ..."""
    return json.loads((Path(out) / STATE_FILE).read_text())


def state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(out: Path, model, optimizer, step: int, args, info: dict, dist_info: Distributed, global_batch: int):
    """The checkpoint of `step` in OUT: every process takes part (the full state of FSDP shards, every process's
    RNG state); the main process writes it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model, options=state_dict_options())
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=state_dict_options())
    rng = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(dist_info.device)] if dist_info.device.type == "cuda" else [])
    rng = dist_info.gather(rng)
    if dist_info.main:
        write_checkpoint(out, unwrapped(model), model_state, optimizer_state, rng, step, args, info, global_batch)
    dist_info.barrier()


def write_checkpoint(out: Path, model, model_state, optimizer_state, rng, step, args, info, global_batch):
    """Every file is written into a fresh staging folder first and moved into OUT only when all are written;
    train_state.json, moved last, names the step."""
    with safe_io.staging_folder(out, prefix=".checkpoint.", last=(STATE_FILE,)) as tmp:
        write_checkpoint_files(tmp, model, model_state, optimizer_state, rng, step, args, info, global_batch)


def write_checkpoint_files(tmp: Path, model, model_state, optimizer_state, rng, step, args, info, global_batch):
    with torch.device("meta"):
        plain = heads.build_task_model(model.config, model.head_config)
    plain.load_state_dict({k: v.float() for k, v in model_state.items()}, assign=True)
    weights.save(plain, tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["sapiens2_training"] = {"task": args.task, "step": step, **{k: v for k, v in info.items() if k != "out_channels"}}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
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
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))


def load_training_state(out: Path, model, optimizer, dist_info: Distributed) -> int:
    """--resume: the optimizer state and this process's RNG states from OUT (the model was loaded from it);
    returns the step the run continues from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = read_state(out)
    step = state["step"]
    # FSDP: only rank 0 reads the full optimizer state; the others receive their shards from it.
    broadcast = isinstance(model, fsdp2()[1]) and dist_info.world > 1
    with safe_open(str(out / OPTIMIZER_FILE), "pt") as f:
        wanted = [k for k in f.keys() if dist_info.main or not broadcast or k.startswith("rng/")]
        tensors = {k: weights.aligned(f.get_tensor(k)) for k in wanted}  # as the uninterrupted run's
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
