"""serve.py's attention explorer: what a task model's backbone attends to on a photo, and what its registers do.

    explorer = Explorer(models, worker, budget_mb=1024)
    explorer.attention(job, image=0, task="seg", block=-1, head="mean", query="patch:3,2")   # grid + heat map
    explorer.norms(job, image=0, task="seg")                                                   # token norms per block

The backbone sees the whole photo resized to its input size without padding (as seg does), so that its patch grid
covers the photo and a click on the photo names a patch. The probabilities come from `backbone(x,
attentions=[block])`, for the block asked for only, computed on the worker's thread and kept per photo and block in
a cache of bounded size (one block is heads x N x N: 0.6 GB for 0.4b at 1024x768 in fp32). The token norms are the
L2 norms of each block's output tokens (the residual stream, before the final norm: where the high-norm outlier
tokens that registers absorb show up).
"""

from __future__ import annotations

import base64
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw

from sapiens2 import processing
from sapiens2_app.predict import pictures
from sapiens2_app.predict.outputs import stamp_random
from sapiens2_app.common.safe_io import encode
from sapiens2_app.serve.serve_jobs import Job, ServeModels, Worker
from sapiens2_app.serve.serve_uploads import ClientError

HEAT_MAP_SIDE = 640  # pixels, the longer side of a heat map (the photo is scaled down to it first)
HEAT_MAP_OPACITY = 0.6
QUERY = re.compile(r"cls|register:([0-9]{1,4})|patch:([0-9]{1,5}),([0-9]{1,5})")  # ASCII digits (\d takes any script's)
WAIT_S = 300  # for the worker: a long photo may be in progress
SMALL_PHOTOS_BYTES = 64 * 2**20  # the photos scaled down for heat maps (~1 MB each)
NORMS_KEPT = 256


@dataclass(frozen=True)
class Query:
    """A query token: the CLS token, register K, or the patch at row R, column C of the grid."""
    kind: str
    register: int = 0
    row: int = 0
    col: int = 0

    def token(self, registers: int, grid: tuple[int, int]) -> int:
        """Its index in the token sequence [CLS, R registers, h*w patches in row-major order]."""
        h, w = grid
        if self.kind == "cls":
            return 0
        if self.kind == "register":
            if self.register >= registers:
                raise ClientError(400, f"query register:{self.register}: this model has {registers} registers "
                                       f"(0..{registers - 1})")
            return 1 + self.register
        if self.row >= h or self.col >= w:
            raise ClientError(400, f"query patch:{self.row},{self.col}: the patch grid is {h} rows x {w} columns")
        return 1 + registers + self.row * w + self.col


def parse_query(text: str) -> Query:
    match = QUERY.fullmatch(text)
    if match is None:
        raise ClientError(400, f"query={text!r}: expected cls, register:K or patch:ROW,COL")
    if match[1] is not None:
        return Query("register", register=int(match[1]))
    if match[2] is not None:
        return Query("patch", row=int(match[2]), col=int(match[3]))
    return Query("cls")


def decoded(photo, decode):
    """`decode(photo.upload)`. A photo whose header passed the upload's checks may still fail to decode (a truncated
    JPEG): that is the client's photo, a 422 naming it as the client did, never by the server's temporary path."""
    try:
        return decode(photo.upload)
    except processing.ImageLoadError as error:
        raise ClientError(422, str(error).replace(str(photo.upload), photo.name)) from None


class BoundedCache:
    """A least-recently-used cache whose entries' weight (`weigh`: bytes, or 1 an entry) stays within a budget; the
    newest entry is always kept, so that a block larger than the budget still answers the clicks on it. Keys start
    with the job's id (drop_job)."""

    def __init__(self, budget: int, weigh=lambda value: 1):
        self.budget, self.weigh = budget, weigh
        self.entries, self.weight, self.lock = OrderedDict(), 0, threading.Lock()

    def get(self, key):
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
            return None

    def put(self, key, value):
        with self.lock:
            if key in self.entries:
                self.weight -= self.weigh(self.entries.pop(key))
            self.entries[key] = value
            self.weight += self.weigh(value)
            while len(self.entries) > 1 and self.weight > self.budget:
                self.weight -= self.weigh(self.entries.popitem(last=False)[1])

    def drop_job(self, job_id: str):
        with self.lock:
            for key in [key for key in self.entries if key[0] == job_id]:
                self.weight -= self.weigh(self.entries.pop(key))


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Explorer:
    """Attention rows and token norms of the jobs' photos, computed on the worker's thread (which owns the models)."""

    def __init__(self, models: ServeModels, worker: Worker, budget_mb: int):
        self.models, self.worker = models, worker
        self.probs = BoundedCache(budget_mb * 2**20, tensor_bytes)  # (job, photo, task, block) -> (heads, N, N)
        self.small = BoundedCache(SMALL_PHOTOS_BYTES, tensor_bytes)  # (job, photo) -> the photo scaled down
        self.norms_of = BoundedCache(NORMS_KEPT)  # (job, photo, task) -> the norms' JSON

    def drop_job(self, job_id: str):
        for cache in (self.probs, self.small, self.norms_of):
            cache.drop_job(job_id)

    # ----- the request's arguments ----------------------------------------------------------------------------
    def target(self, job: Job, image: int, task: str | None):
        """(the photo, the task whose backbone looks, that backbone), or a ClientError saying what is wrong."""
        if not 0 <= image < len(job.photos):
            raise ClientError(400, f"image={image}: the job has {len(job.photos)} images (0..{len(job.photos) - 1})")
        photo = job.photos[image]
        if photo.upload is None:
            raise ClientError(400, f"image={image}: {photo.error}")
        task = task or job.tasks[0]
        if task not in job.tasks:
            raise ClientError(400, f"task={task}: not a task of this job ({', '.join(job.tasks)})")
        return photo, task, self.models.loaded[task].backbone

    def grid_size(self, backbone) -> tuple[int, int]:
        """(h, w) of the patch grid: the model input size over the size multiple (a patch, or a 4K window)."""
        config = backbone.config
        height, width = self.models.size or tuple(config.image_size)
        return height // config.size_multiple, width // config.size_multiple

    def pixels(self, photo, backbone) -> torch.Tensor:
        image = decoded(photo, processing.load_image)
        size = self.models.size or tuple(backbone.config.image_size)
        inputs = processing.preprocess([image], size, pad=False, resample=self.models.resample,
                                       device=self.models.device)
        return inputs.pixel_values.to(self.models.dtype)

    # ----- attention --------------------------------------------------------------------------------------------
    def attention(self, job: Job, image: int, task: str | None, block: int, head: str, query: str) -> dict:
        photo, task, backbone = self.target(job, image, task)
        config = backbone.config
        if not -config.depth <= block < config.depth:
            raise ClientError(400, f"block={block}: the {task} backbone has {config.depth} blocks "
                                   f"(0..{config.depth - 1}, or -1 for the last)")
        block %= config.depth
        if head != "mean" and not (re.fullmatch(r"[0-9]{1,4}", head) and int(head) < config.num_heads):
            raise ClientError(400, f"head={head}: expected mean or a head from 0 to {config.num_heads - 1}")
        grid = self.grid_size(backbone)
        wanted = parse_query(query)
        token = wanted.token(config.num_register_tokens, grid)
        probs = self.probabilities(job, image, task, block, photo, backbone)
        maps = processing.attention_grid(probs, grid, query=token, average_heads=head == "mean")  # (h, w) or (H, h, w)
        chosen = maps if head == "mean" else maps[int(head)]
        picture = self.heat_map(job, image, photo, chosen, wanted, self.models.loaded[task].random)
        return {"image": image, "task": task, "block": block, "depth": config.depth, "head": head,
                "heads": config.num_heads, "registers": config.num_register_tokens, "query": query, "token": token,
                "rows": grid[0], "cols": grid[1], "grid": chosen.tolist(),
                "png": "data:image/png;base64," + base64.b64encode(encode(picture, ".png")).decode("ascii"),
                "random_weights": self.models.loaded[task].random}

    def probabilities(self, job: Job, image: int, task: str, block: int, photo, backbone) -> torch.Tensor:
        """(heads, N, N) of one block on one photo: from the cache, else computed by the worker."""
        key = (job.id, image, task, block)

        def compute():
            if (cached := self.probs.get(key)) is not None:  # another request asked first
                return cached
            with torch.no_grad():
                out = backbone(self.pixels(photo, backbone), attentions=[block])
            probs = out.attentions[block][0].cpu()  # (heads, N, N), in the model's dtype
            self.probs.put(key, probs)
            return probs

        cached = self.probs.get(key)
        return cached if cached is not None else self.worker.call(compute, WAIT_S)

    def heat_map(self, job: Job, image: int, photo, grid: torch.Tensor, query: Query, random: bool) -> Image.Image:
        """The row as a Turbo heat map over the photo (scaled down), the queried patch outlined in white."""
        small = self.small_photo(job, image, photo)
        picture = pictures.attention_to_image(grid, small, opacity=HEAT_MAP_OPACITY)
        if query.kind == "patch":
            h, w = grid.shape
            cell_h, cell_w = picture.height / h, picture.width / w
            box = (query.col * cell_w, query.row * cell_h, (query.col + 1) * cell_w - 1, (query.row + 1) * cell_h - 1)
            line = max(1, min(3, round(min(cell_h, cell_w) / 8)))
            ImageDraw.Draw(picture).rectangle(box, outline=(255, 255, 255), width=line)
        return stamp_random(picture) if random else picture

    def small_photo(self, job: Job, image: int, photo) -> torch.Tensor:
        key = (job.id, image)
        if (small := self.small.get(key)) is not None:
            return small
        picture = decoded(photo, pictures.to_pil)
        scale = HEAT_MAP_SIDE / max(picture.size)
        if scale < 1:
            picture = picture.resize((max(1, round(picture.width * scale)), max(1, round(picture.height * scale))),
                                     Image.BILINEAR)
        small = processing.load_image(picture)
        self.small.put(key, small)
        return small

    # ----- token norms ------------------------------------------------------------------------------------------
    def norms(self, job: Job, image: int, task: str | None) -> dict:
        """Per block, the L2 norm of the CLS token, of each register and of the patches (mean and max)."""
        photo, task, backbone = self.target(job, image, task)
        key = (job.id, image, task)
        if (known := self.norms_of.get(key)) is not None:
            return known

        def compute():
            depth = backbone.config.depth
            with torch.no_grad():
                out = backbone(self.pixels(photo, backbone), layers=list(range(depth)))
            patches = [layer[0].float().norm(dim=0) for layer in out.layers]  # (h, w) each
            return {"image": image, "task": task, "depth": depth, "registers": backbone.config.num_register_tokens,
                    "cls": [t[0].float().norm().item() for t in out.layer_cls],
                    "register_norms": [t[0].float().norm(dim=-1).tolist() for t in out.layer_registers],
                    "patches_mean": [p.mean().item() for p in patches],
                    "patches_max": [p.max().item() for p in patches]}

        result = self.worker.call(compute, WAIT_S)
        self.norms_of.put(key, result)
        return result
