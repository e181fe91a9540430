"""What each process of a training run reads, and how: the sample order of every step (the same global batches on
any number of processes, and on --resume), the validation rows, and the loaders: a user error met by a data
worker comes back as one line, and the workers stop with the run."""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import signal

import torch

from sapiens2 import processing
from sapiens2_app.common.cli import UsageError
from sapiens2_app.train.datasets import collate
from sapiens2_app.train.distributed import Distributed

# The errors that are the user's (bad data or checkpoint, a missing file or data file of the installation):
# train.py reports them as one `error:` line (exit status 2), and a data worker carries them back as one.
USER_ERRORS = (UsageError, processing.ImageLoadError, FileNotFoundError, processing.MissingDataError)


# ----------------------------------------------------------------------------------------------------
# Sampling: the global order is a function of (seed, epoch); each process takes its slice of each step
# ----------------------------------------------------------------------------------------------------
class StepSampler:
    """Yields, per micro-step, this process's [(index, augmentation seed)] from step `start` to `stop`."""

    def __init__(self, count: int, args, dist_info: Distributed, start: int, stop: int):
        self.count, self.seed, self.start, self.stop = count, args.seed, start, stop
        self.per_process, self.accumulate = args.batch_size, args.accumulate
        self.world, self.rank = dist_info.world, dist_info.rank
        self.global_batch = self.per_process * self.world * self.accumulate
        self.steps_per_epoch = count // self.global_batch

    def order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.count, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))

    def __iter__(self):
        for step in range(self.start, self.stop):
            epoch, within = divmod(step, self.steps_per_epoch)
            order = self.order(epoch)
            for micro in range(self.accumulate):
                first = within * self.global_batch + (micro * self.world + self.rank) * self.per_process
                positions = range(first, first + self.per_process)
                yield [(int(order[p]), self.sample_seed(epoch, p)) for p in positions]

    def sample_seed(self, epoch: int, position: int) -> int:
        return (self.seed * 1_000_003 + epoch * self.count + position) % (2**62)

    def __len__(self) -> int:
        return (self.stop - self.start) * self.accumulate


def eval_batches(count: int, batch_size: int, dist_info: Distributed):
    """Validation rows for this process: (index list, valid flags), the same number of batches on every
    process (FSDP needs every process in every forward); rows past the end repeat row 0 and do not count."""
    per_round = batch_size * dist_info.world
    rounds = math.ceil(count / per_round)
    for r in range(rounds):
        first = r * per_round + dist_info.rank * batch_size
        rows = list(range(first, first + batch_size))
        yield [i if i < count else 0 for i in rows], torch.tensor([i < count for i in rows])


# ----------------------------------------------------------------------------------------------------
# Data loading: user errors found by a worker come back as one line; the workers stop with the run
# ----------------------------------------------------------------------------------------------------
class SampleFailure:
    """A user error (USER_ERRORS: a bad label, an unreadable image) met while reading a sample, carried as a
    value from a data worker to the training process, which raises it as the one line it is (raised in the
    worker, torch would re-raise it with the worker's traceback in its message)."""

    def __init__(self, message: str):
        self.message = message


class ReadOrFail:
    """A dataset whose samples are the dataset's, or a SampleFailure."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        try:
            return self.dataset[key]
        except USER_ERRORS as error:
            return SampleFailure(str(error))


def collate_or_fail(samples: list) -> dict | SampleFailure:
    return next((s for s in samples if isinstance(s, SampleFailure)), None) or collate(samples)


def data_loader(dataset, batch_sampler, workers: int, **options) -> torch.utils.data.DataLoader:
    """The training and validation loaders: batches, or SampleFailures that Batches raises."""
    run_over = multiprocessing.Event()  # set by Batches when it stops the workers (worker_signals)
    # Each iterator draws a base seed (unused: the samples seed their own generators) from `generator`; from the
    # global RNG, that draw would put a resumed run's global RNG (dropout, restored from the checkpoint) one ahead.
    loader = torch.utils.data.DataLoader(ReadOrFail(dataset), batch_sampler=batch_sampler, collate_fn=collate_or_fail,
                                         num_workers=workers, generator=torch.Generator().manual_seed(0),
                                         worker_init_fn=functools.partial(worker_signals, run_over), **options)
    loader.run_over = run_over
    return loader


def worker_signals(run_over, _worker_id: int):
    """In a data worker: Ctrl-C is the main process's to act on (it reaches the whole process group, and the main
    process finishes its step, which may need this worker's batches), and so is a SIGTERM sent to the group (a
    scheduler's notice), until the main process stops the workers: then SIGTERM (torch's and multiprocessing's
    way to end a worker that did not leave by itself) ends the worker. A worker that ignored it then would keep
    the interpreter's exit waiting for it forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0) if run_over.is_set() else None)


class Batches:
    """A loader's batches, as a context manager: a SampleFailure is raised here (a UsageError, exit
    status 2), and leaving stops the worker processes, however it is left: left to garbage collection they
    could live on to the interpreter's exit (an exception's traceback can hold the iterator in a reference
    cycle), and a worker still busy when torch stops it gets SIGTERM, which must then end it (worker_signals)."""

    def __init__(self, loader: torch.utils.data.DataLoader):
        self.run_over = getattr(loader, "run_over", None)
        self.iterator = iter(loader)

    def __enter__(self) -> "Batches":
        return self

    def __exit__(self, *exc):
        if self.run_over is not None:
            self.run_over.set()  # first: from here a SIGTERM ends the workers
        shutdown = getattr(self.iterator, "_shutdown_workers", None)  # torch has no public close; none without workers
        if shutdown is not None:
            shutdown()

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> dict:
        batch = next(self.iterator)
        if isinstance(batch, SampleFailure):
            raise UsageError(batch.message)
        return batch
