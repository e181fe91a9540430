"""The person detector's cost beside the pose model's: parameters, FLOPs and latency per call.

    python bench/detector.py                                  # D-FINE small at 640x640 and pose-0.4b at 1024x768
    python bench/detector.py --detectors nano,small,medium --reps 5 --device cuda --dtype bf16

Both models get random weights with the released architectures (nothing is downloaded): the D-FINE sizes as
transformers' conversion script builds them (convert_d_fine_original_pytorch_checkpoint_to_hf.py), pose-0.4b
from heads.py's presets. Pose runs once per person box, twice with the flip test (predict.py's default); the
detector once per image.

FLOPs (2 per multiply-add) are counted on the meta device with hooks: every nn.Linear and nn.Conv2d, plus
4 N^2 d per head in each self-attention; the deformable attention's bilinear sampling (~10 FLOPs per sampled
channel, under 0.1% here) is left out. For the pose model bench/e2e_models.py's count_flops is reused.
Latency: `--warmup` calls, then the median of `--reps` timed calls (bench/e2e_measure.py's time_calls: CUDA events on a
GPU, time.perf_counter on CPU), under torch.inference_mode. Results: bench/results/detector-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the root, so bench/kernels.py cannot shadow kernels/

from sapiens2_app.detector import detector  # noqa: E402
from sapiens2_app.detector.dfine import DFine  # noqa: E402
from sapiens2_app.detector.dfine_backbone import SelfAttention  # noqa: E402
from sapiens2_app.detector.dfine_config import DFineConfig  # noqa: E402
from e2e_measure import device_name, device_slug, time_calls  # noqa: E402
from e2e_models import DTYPES, build_ours, count_flops  # noqa: E402
from sapiens2_app.common import safe_io  # noqa: E402
from sapiens2_app.common.runtime_info import versions  # noqa: E402

# The released COCO architectures (transformers' conversion script; every other field is DFineConfig's default).
_B0 = dict(stem_channels=[3, 16, 16], stage_in_channels=[16, 64, 256, 512], stage_mid_channels=[16, 32, 64, 128],
           stage_out_channels=[64, 256, 512, 1024], stage_num_blocks=[1, 1, 2, 1], stage_numb_of_layers=[3, 3, 3, 3],
           use_learnable_affine_block=True)
DFINE_ARCHS = {
    "nano": dict(_B0, out_indices=[3, 4], num_feature_levels=2, encoder_ffn_dim=512, encode_proj_layers=[1],
                 d_model=128, encoder_hidden_dim=128, decoder_ffn_dim=512, decoder_n_points=[6, 6],
                 decoder_in_channels=[128, 128], depth_mult=0.5, decoder_layers=3, hidden_expansion=0.34),
    "small": dict(_B0, decoder_layers=3, hidden_expansion=0.5, depth_mult=0.34, decoder_n_points=[3, 6, 3]),
    "medium": dict(stem_channels=[3, 24, 32], stage_in_channels=[32, 96, 384, 768],
                   stage_mid_channels=[32, 64, 128, 256], stage_out_channels=[96, 384, 768, 1536],
                   stage_num_blocks=[1, 1, 3, 1], stage_numb_of_layers=[4, 4, 4, 4], use_learnable_affine_block=True,
                   decoder_layers=4, decoder_n_points=[3, 6, 3], depth_mult=0.67),
}


def dfine(size: str) -> DFine:
    return DFine(DFineConfig(num_labels=80, **DFINE_ARCHS[size]))


def count_detector_flops(size: str, input_size=detector.INPUT_SIZE) -> dict:
    totals = {"linear": 0, "conv": 0, "attention": 0}

    def linear(mod, inputs, output):
        totals["linear"] += 2 * inputs[0].numel() * mod.out_features

    def conv(mod, inputs, output):
        totals["conv"] += 2 * output.numel() * (mod.in_channels // mod.groups) * mod.kernel_size[0] * mod.kernel_size[1]

    def attention(mod, inputs, output):
        B, N, C = inputs[0].shape
        totals["attention"] += 4 * B * N * N * C  # q k^T and p v over all heads: h * d = C

    with torch.device("meta"):
        model = dfine(size)
        for mod in model.modules():
            hook = {torch.nn.Linear: linear, torch.nn.Conv2d: conv, SelfAttention: attention}.get(type(mod))
            if hook:
                mod.register_forward_hook(hook)
        with torch.no_grad():
            model(torch.empty(1, 3, *input_size))
    return dict(flops=sum(totals.values()), params=sum(p.numel() for p in model.parameters()), **{
        f"flops_{k}": v for k, v in totals.items()})


def measure(name: str, model: torch.nn.Module, inputs: torch.Tensor, args, warmup: int, reps: int) -> dict:
    model = model.to(args.device, DTYPES[args.dtype]).eval()
    inputs = inputs.to(args.device, DTYPES[args.dtype])
    with torch.inference_mode():
        times = time_calls(lambda: model(inputs), args.device, warmup, reps)
    print(f"{name}: median {statistics.median(times):.1f} ms over {len(times)} calls", file=sys.stderr)
    return dict(times_ms=times, median_ms=statistics.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--detectors", default="small", help=f"comma-separated: {', '.join(DFINE_ARCHS)}")
    parser.add_argument("--pose-size", default="1024x768", help="pose input HxW (released: 1024x768)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pose-reps", type=int, default=1,
                        help="timed pose calls (0: FLOPs only); one 1024x768 call takes ~3 minutes on a busy "
                             "2-core CPU")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    pose_size = tuple(int(v) for v in args.pose_size.split("x"))
    torch.manual_seed(0)
    rows = []
    for size in args.detectors.split(","):
        row = {"model": f"D-FINE {size} (person detector)", "input": "x".join(map(str, detector.INPUT_SIZE)),
               "per": "image", **count_detector_flops(size)}
        row.update(measure(row["model"], dfine(size), torch.rand(1, 3, *detector.INPUT_SIZE), args, args.warmup,
                           args.reps))
        rows.append(row)
    pose = {"model": "Sapiens2 pose-0.4b", "input": args.pose_size, "per": "person (x2 with the flip test)",
            **count_flops("0.4b", "pose", 1, pose_size, args.dtype)}
    if args.pose_reps:
        pose.update(measure(pose["model"], build_ours("0.4b", "pose", pose_size), torch.rand(1, 3, *pose_size),
                            args, int(args.device != "cpu"), args.pose_reps))  # CPU: no warm-up needed (measured
        # 178 s for the first 1024x768 call, 180 s for the second, on a loaded 2-core machine)
    rows.append(pose)
    for row in rows[:-1]:  # the detector's share of one image with one person, flip test on
        row["share_of_one_person_image"] = {
            key: row[key] / (row[key] + 2 * pose[key]) for key in ("flops", "median_ms") if key in pose}
    data = {"device": device_name(args.device), "dtype": args.dtype, "versions": versions(),
            "load_average_at_end": os.getloadavg(), "rows": rows}  # a shared machine: other processes slow both rows
    out = args.out or ROOT / "bench" / "results" / f"detector-{device_slug(args.device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(safe_io.json_text(data, indent=1))
    out.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))


def markdown(data: dict) -> str:
    lines = [f"{data['device']}, {data['dtype']}, torch {data['versions']['torch']}", "",
             "| model | input | per | params | GFLOPs | ms (median) | share of a 1-person image (FLOPs / time) |",
             "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        share = row.get("share_of_one_person_image", {})
        share_text = " / ".join(f"{share[k]:.1%}" for k in ("flops", "median_ms") if k in share)
        ms = f"{row['median_ms']:.0f}" if "median_ms" in row else "-"
        lines.append(f"| {row['model']} | {row['input']} | {row['per']} | {row['params'] / 1e6:.1f} M | "
                     f"{row['flops'] / 1e9:.1f} | {ms} | {share_text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
