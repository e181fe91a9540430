"""The processes of a training run (torchrun's environment; one process without it), their devices, and the model
as they hold it: DDP, FSDP2 shards, blocks that recompute their activations."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

from sapiens2_app.common.cli import pick_device, rank_and_world


class Distributed:
    """This process's rank, the process count and device (torchrun's environment; one process without it).
    A bad RANK / WORLD_SIZE / LOCAL_RANK or --device is a UsageError (cli.rank_and_world, cli.pick_device)."""

    def __init__(self, device_name: str | None, fsdp: bool = False):
        self.rank, self.world = rank_and_world()
        self.device = pick_device(device_name)  # default cuda:LOCAL_RANK when CUDA is available, else the CPU
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        launched = "MASTER_ADDR" in os.environ  # torchrun (FSDP needs the process group even for 1 process)
        if (self.world > 1 or (fsdp and launched)) and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def grouped(self) -> bool:
        """Whether the processes form a torch.distributed process group (what FSDP shards over)."""
        return dist.is_initialized()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            moved = tensor.to(self.device)
            dist.all_reduce(moved)
            tensor = moved.to(tensor.device)
        return tensor

    def any(self, flag: bool) -> bool:
        """Whether `flag` is set on any process (so that all of them act on it at the same step)."""
        return self.all_reduce(torch.tensor([float(flag)])).item() > 0

    def gather(self, value) -> list:
        """`value` of every process, by rank (picklable values: RNG states)."""
        if self.world == 1:
            return [value]
        gathered = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self):
        if self.world > 1:
            dist.barrier()


def close():
    """Leave the process group, if there is one, after what is left of the run that holds it (the DDP reducer, the
    FSDP state). Some of the run's objects sit in reference cycles (frames of the optimizer's construction, kept
    inside torch, hold the frames that hold the model), which only the cyclic collector frees: left to it, they
    may go at interpreter shutdown, after the group, where gloo's threads can abort the process ("terminate called
    without an active exception", one rank's exit -6). Collected here, they go first."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def wrap(model, args, dist_info: Distributed):
    """DDP (several processes), FSDP2 (--fsdp) or the plain model."""
    if args.fsdp:
        fully_shard, _ = fsdp2()
        for block in model.backbone.blocks:  # shard first: no process holds the whole model on its device
            fully_shard(block)
        fully_shard(model)
        return model.to(dist_info.device)
    model.to(dist_info.device)
    if dist_info.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=False)
    return model


def fsdp2():
    """(fully_shard, FSDPModule): public in torch.distributed.fsdp since torch 2.6, _composable before."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard
    return fully_shard, FSDPModule


def unwrapped(model):
    return getattr(model, "module", model)
