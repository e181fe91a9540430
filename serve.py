#!/usr/bin/env python3
"""Every task on your photos in the browser, and an explorer of what the model attends to: a local web server.

    python serve.py                                         # http://127.0.0.1:8765/ : seg, normal, pointmap, pose
    python serve.py --tasks seg,pose,matting --model 1b     # other tasks, another size
    python serve.py --model albedo=my_albedo.safetensors    # adds albedo, from your checkpoint
    python serve.py --random-init always --random-backbone 0.1b   # nothing downloaded: random weights, said loudly

The page (sapiens2_app/serve/static/) drops photos onto the server and shows each task's pictures as they are made; every
file predict.py would write can be downloaded, byte for byte the same, and for each photo an attention explorer
shows the attention of any patch, the CLS token or a register, per block and head, and the token norms per block.
The page uses only the HTTP API that scripts can use too (docs/serve.md). The modules: sapiens2_app/serve/serve_http.py
(routes and request checks), serve_requests.py (Host/Origin, Content-Length, query and header values), serve_server.py
(the server, its connection bound), serve_uploads.py (multipart, photo checks), serve_jobs.py (jobs, the worker,
expiry), serve_attention.py (attention rows, heat maps, token norms).

It binds 127.0.0.1: only this machine can reach it. Results live in a temporary folder removed at exit. Ctrl-C or
SIGTERM stops it within seconds. Exit status: 0 when stopped so, 2 when it cannot start (bad arguments, port in
use, checkpoints).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from sapiens2 import PRESETS, processing
from sapiens2_app.detector import detector
from sapiens2_app.predict import models
from sapiens2_app.common.artefacts import TASKS
from sapiens2_app.common.cli import (OneLineErrorParser, StopSignals, UsageError, number_in, parse_size, parse_tasks,
                              pick_device)
from sapiens2_app.predict.models import (CONVENTIONS, RANDOM_INIT, LoadedModel, ModelChoice, pick_dtype,
                                         random_banner)
from sapiens2_app.common.safe_io import signals_deferred
from sapiens2_app.serve.serve_attention import Explorer
from sapiens2_app.serve.serve_http import App
from sapiens2_app.serve.serve_jobs import JobStore, ServeModels, Worker
from sapiens2_app.serve.serve_requests import LOOPBACK_NAMES, limits_json
from sapiens2_app.serve.serve_server import Service

DEFAULT_TASKS = "seg,normal,pointmap,pose"
DEFAULT_PORT = 8765


def build_parser(prog: str = "serve.py") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=prog, description="Sapiens2 in the browser: a local web server for "
                                "every task on your photos and an attention explorer (docs/serve.md).")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default %(default)s: this machine only); another one makes the "
                             "server reachable from other machines, without any authentication")
    parser.add_argument("--port", type=number_in(int, 0, 65535), default=DEFAULT_PORT,
                        help="port (default %(default)s; 0: any free port)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="a host name requests may give besides the bound address and localhost (repeat it)")
    parser.add_argument("--tasks", metavar="TASKS",
                        help=f"the tasks the page offers (default {DEFAULT_TASKS}, plus each task given its own "
                             f"--model TASK=SOURCE); any of {', '.join(TASKS)}")
    parser.add_argument("--model", action="append", default=[], metavar="SOURCE",
                        help="as predict.py's: a size (0.4b, default), a task preset (seg-1b), a .safetensors file, "
                             "a folder or a hub id; TASK=SOURCE for one task (repeat the option)")
    parser.add_argument("--random-init", choices=RANDOM_INIT, default="never",
                        help="as predict.py's: random weights instead of checkpoints ('fallback' when a download "
                             "fails); every picture then says so and the page shows a banner")
    parser.add_argument("--random-backbone", choices=list(PRESETS), help="backbone size of random models")
    parser.add_argument("--detector", default=detector.DEFAULT_DETECTOR, metavar="SOURCE",
                        help="pose: person boxes from this D-FINE detector, 'seg' (the segmentation's blobs) or "
                             "'none' (the whole image); default %(default)s")
    parser.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when there is a GPU)")
    parser.add_argument("--dtype", choices=["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"],
                        help="default: bfloat16 on GPUs that support it, else float32")
    parser.add_argument("--size", type=parse_size, metavar="HxW", help="model input size (default: the model's)")
    parser.add_argument("--conventions", choices=list(CONVENTIONS), default="original",
                        help="as predict.py's (default %(default)s)")
    parser.add_argument("--no-flip", dest="flip", action="store_false", help="pose: skip the flip test")
    parser.add_argument("--max-upload-mb", type=number_in(int, 1, 4096), default=50, metavar="MB",
                        help="largest upload, all its photos together (default %(default)s)")
    parser.add_argument("--queue-size", type=number_in(int, 1, 1000), default=4, metavar="N",
                        help="jobs that may wait for the one worker; more are refused with 503 (default %(default)s)")
    parser.add_argument("--keep-jobs", type=number_in(int, 1, 10000), default=20, metavar="N",
                        help="finished jobs kept; older ones are removed with their files (default %(default)s)")
    parser.add_argument("--attention-cache-mb", type=number_in(int, 0, 1 << 20), default=2048, metavar="MB",
                        help="attention maps kept in memory (one block of 0.4b at 1024x768: 600 MB; the newest is "
                             "always kept; default %(default)s)")
    return parser


STOP_TIMEOUT_S = 3.0  # how long a stop waits for the photo in progress, then for a write in progress


def main(argv: list[str] | None = None, prog: str = "serve.py") -> int:
    """Serve until Ctrl-C or SIGTERM. The stop is bounded whatever is in flight: after STOP_TIMEOUT_S for the worker
    (and as long for a write), with the temporary folder removed, the process ends at once (end_now) rather than
    wait for a model call that may run for minutes, or for what it started (threads the interpreter joins at exit)."""
    args = build_parser(prog).parse_args(argv)
    stopped = True
    try:
        with StopSignals():
            service = start(args)
            try:
                print(f"serving {service.url}  (Ctrl-C stops; results in {service.app.store.folder}, removed at "
                      f"exit)", file=sys.stderr, flush=True)
                service.serve_forever()
            finally:
                with signals_deferred():  # a second Ctrl-C must not leave the temporary folder behind
                    stopped = service.close(STOP_TIMEOUT_S)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstopped; the temporary folder is removed", file=sys.stderr)
    if not stopped:
        end_now(0)
    return 0


def end_now(status: int):
    """Exit without the interpreter's shutdown, which would wait for the threads the work in flight started (and
    may hang in a native library's exit handlers while a daemon thread is inside a model call)."""
    print(f"note: work in flight after {STOP_TIMEOUT_S:g} s was abandoned", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def start(args) -> Service:
    """Everything checked (arguments, data files, the port, by binding it) before the models load, then loaded: a
    Service ready to serve."""
    tasks = served_tasks(args.tasks, args.model)
    try:
        processing.check_data_files()
    except processing.MissingDataError as error:
        raise UsageError(str(error)) from None
    models.check_model_sources(args.model)
    hosts = accepted_hosts(args.host, args.allow_host)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    try:
        service = Service(args.host, args.port)
    except OSError as error:
        raise UsageError(f"cannot serve on {args.host} port {args.port} ({error.strerror or error}); pick another "
                         f"--port (0: any free one)") from None
    try:
        serve_models = load(args, tasks, device, dtype)
        if serve_models.banner:
            print(serve_models.banner, file=sys.stderr)
        store = JobStore(args.keep_jobs)
        worker = Worker(serve_models, store, args.queue_size)
        explorer = Explorer(serve_models, worker, args.attention_cache_mb)
        store.on_expire.append(explorer.drop_job)
        service.attach(App(serve_models, store, worker, explorer, hosts, args.max_upload_mb * 2**20,
                           limits_json(args.max_upload_mb, args.keep_jobs), models_json(serve_models)))
        worker.start()
    except BaseException:
        service.close()
        raise
    return service


def served_tasks(text: str | None, model_specs: list[str]) -> list[str]:
    """--tasks, else the defaults and each task given a checkpoint of its own (--model albedo=FILE adds albedo)."""
    if text is not None:
        return parse_tasks(text)
    own = [spec.partition("=")[0] for spec in model_specs if spec.partition("=")[0] in TASKS]
    return parse_tasks(",".join([DEFAULT_TASKS, *own]))


def accepted_hosts(host: str, allowed: list[str]) -> frozenset[str]:
    """The names a request's Host header may give: the bound address, localhost's names and --allow-host; a warning
    when the bound address is reachable from other machines."""
    name = host.strip("[]").lower()
    try:
        loopback = name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        print(f"warning: --host {host}: other machines can reach this server, and anyone who can may run the models "
              f"and read every result (there is no authentication). Requests must name this host as {name}"
              + (" or localhost; add --allow-host NAME for the names others use" if not allowed else ""),
              file=sys.stderr)
    return frozenset({name, *LOOPBACK_NAMES, *(a.strip("[]").lower() for a in allowed)})


def load(args, tasks: list[str], device, dtype) -> ServeModels:
    """predict.py's models and settings for these tasks (models.load_for_tasks), as predict.py would load them."""
    conventions = CONVENTIONS[args.conventions]
    choice = ModelChoice(tuple(args.model), args.random_init, args.random_backbone, conventions["rope"])
    loaded, person_detector, boxes_from = models.load_for_tasks(choice, tasks, device, dtype, args.detector,
                                                                size=args.size, flip=args.flip)
    banner = random_banner(loaded, args.random_init, boxes_from) if any(m.random for m in loaded.values()) else None
    return ServeModels(loaded, tasks, device, dtype, 4 if device.type == "cuda" else 1, args.size, args.flip,
                       person_detector, boxes_from, conventions["resample"], banner)


def models_json(serve_models: ServeModels) -> dict:
    """/api/health's models: where each comes from, whether its weights are random, what the explorer needs."""
    def one(task: str, loaded: LoadedModel) -> dict:
        config = loaded.backbone.config
        return {"source": loaded.source, "random_weights": loaded.random, "offered": task in serve_models.offered,
                "depth": config.depth, "heads": config.num_heads, "registers": config.num_register_tokens,
                "embed_dim": config.embed_dim, "input_size": list(serve_models.size or config.image_size)}

    return {task: one(task, loaded) for task, loaded in serve_models.loaded.items()}


if __name__ == "__main__":
    sys.exit(main())
