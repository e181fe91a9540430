"""bench/e2e.py's results: the numbers derived from each row (achieved FLOP/s, fraction of the device's peak, speedups
and memory against transformers), the Markdown table, the plot, and the line printed as each row finishes."""

from __future__ import annotations

import json
import pathlib

from sapiens2_app.common.runtime_info import device_peaks
from e2e_jobs import group_key
from e2e_models import IMPLS, MODELS


def add_derived(rows: list[dict], dev_name: str):
    by_group: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_group.setdefault(group_key(r), {})[r["impl"]] = r
    for r in rows:
        if r.get("median_ms") is None:
            continue
        s = r["median_ms"] / 1e3
        r["achieved_tflops"] = r["flops"] / s / 1e12
        r["achieved_gbs"] = r["bytes"] / s / 1e9
        peak, _ = device_peaks(dev_name, r["dtype"]) if r["device"] == "cuda" else (None, None)
        r["peak_tflops"] = peak
        r["peak_fraction"] = r["achieved_tflops"] / peak if peak else None
        r["flop_floor_ms"] = r["flops"] / (peak * 1e12) * 1e3 if peak else None
        group = by_group[group_key(r)]
        for base in ("hf", "hf-compile"):
            b = group.get(base)
            ok = b is not None and b.get("median_ms") and b["status"] == "ok"
            r[f"speedup_vs_{base.replace('-', '_')}"] = b["median_ms"] / r["median_ms"] if ok else None
        hf = group.get("hf")
        ok = hf is not None and hf["status"] == "ok" and hf.get("peak_mb") and r.get("peak_mb") is not None
        r["memory_vs_hf"] = r["peak_mb"] / hf["peak_mb"] if ok else None


def sort_rows(rows):
    order = {i: n for n, i in enumerate(IMPLS)}
    return sorted(rows, key=lambda r: (r["preset"], MODELS.index(r["model"]), r["batch"], r["dtype"], order[r["impl"]]))


def write_markdown(data: dict, path: pathlib.Path):
    cuda = data["device_kind"] == "cuda"
    unit = "TFLOP/s" if cuda else "GFLOP/s"
    scale = 1 if cuda else 1e3
    lines = [
        f"# End-to-end forward: {data['device']}",
        "",
        f"{data['date']} · torch {data['versions']['torch']} · transformers {data['versions'].get('transformers')} · "
        f"triton {data['versions'].get('triton')} · `{data['command']}`",
        "",
        "Median of the timed calls (after warm-up), spread = IQR; img/s = batch / median; peak MB = memory one call "
        f"adds on top of the loaded model ({data['memory_method']}); mem/HF = peak MB / the hf row's"
        + ("" if cuda else "; RSS MB = the process's peak RSS during one call - RSS before (a noisy cross-check)")
        + "; rel err = max|x - ref| / max|ref| against the "
        "group's reference row (hf, else ours) on the same random weights and input; ×HF, ×compile(HF) = speedup "
        "over those rows (>1: faster). FLOPs: linear + conv + attention (4·N²·D per head), counted in code.",
        "",
        f"| preset | model | batch | dtype | impl | median ms | IQR ms | img/s | peak MB | mem/HF | "
        + ("" if cuda else "RSS MB | ") + f"{unit} | "
        + ("% peak | floor ms | " if cuda else "") + "×HF | ×compile(HF) | rel err | status |",
        "|" + "---|" * (17 if cuda else 16),
    ]

    def f(v, spec):
        return "" if v is None else format(v, spec)

    for r in sort_rows(data["rows"]):
        status = r["status"] if r["status"] != "ok" else "ok"
        if r.get("reason") and r["status"] != "ok":
            status += f": {r['reason'][:90]}"
        cells = [r["preset"], r["model"], str(r["batch"]), r["dtype"], r["impl"], f(r.get("median_ms"), ".1f"),
                 f(r.get("iqr_ms"), ".1f"), f(r.get("images_per_s"), ".2f"), f(r.get("peak_mb"), ".1f"),
                 f(r.get("memory_vs_hf"), ".2f")]
        if not cuda:
            cells.append(f(r.get("rss_peak_mb"), ".0f"))
        cells.append(f(r["achieved_tflops"] * scale if r.get("achieved_tflops") else None, ".1f"))
        if cuda:
            cells += [f(r["peak_fraction"] * 100 if r.get("peak_fraction") else None, ".1f"), f(r.get("flop_floor_ms"), ".1f")]
        cells += [f(r.get("speedup_vs_hf"), ".2f"), f(r.get("speedup_vs_hf_compile"), ".2f"), f(r.get("rel_err"), ".1e"),
                  status.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    path.write_text("\n".join(lines))


def write_plot(data: dict, path: pathlib.Path):
    """Horizontal bars of images/s per row, grouped by (preset, model, batch), one colour per impl."""
    from PIL import Image, ImageDraw, ImageFont

    rows = [r for r in sort_rows(data["rows"]) if r.get("images_per_s")]
    if not rows:
        return
    colours = {"hf": (120, 120, 120), "hf-eager": (180, 180, 180), "hf-compile": (60, 60, 60),
               "ours": (90, 150, 220), "ours-cl": (150, 190, 235), "ours-triton": (220, 90, 40),
               "ours-triton-cl": (240, 140, 100), "ours-compile": (40, 90, 170),
               "ours-graph": (240, 170, 40)}
    try:
        font = ImageFont.load_default(size=14)
    except TypeError:
        font = ImageFont.load_default()
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['preset']} {r['model']} b{r['batch']} {r['dtype']}", []).append(r)
    bar, gap, left, right, top = 16, 14, 250, 140, 60
    height = top + sum(len(g) * bar + gap for g in groups.values()) + 40
    width = 1100
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 10), f"Sapiens2 forward, images/s (longer is better), bars scaled per group: {data['device']}", fill="black", font=font)
    d.text((10, 30), f"{data['date']}, torch {data['versions']['torch']}, image {rows[0]['size'][0]}x{rows[0]['size'][1]}",
           fill=(80, 80, 80), font=font)
    y = top
    span = width - left - right
    for label, group in groups.items():
        best = max(r["images_per_s"] for r in group)
        d.text((10, y + (len(group) * bar) // 2 - 8), label, fill="black", font=font)
        for r in group:
            w = max(1, int(span * r["images_per_s"] / best))
            d.rectangle([left, y + 1, left + w, y + bar - 2], fill=colours.get(r["impl"], (0, 160, 0)))
            mark = "" if r["status"] == "ok" else f"  {r['status']}"
            d.text((left + w + 6, y), f"{r['impl']}  {r['images_per_s']:.2f}{mark}", fill="black", font=font)
            y += bar
        y += gap
    img.save(path)


def render(json_path: pathlib.Path):
    data = json.loads(json_path.read_text())
    write_markdown(data, json_path.with_suffix(".md"))
    write_plot(data, json_path.with_suffix(".png"))


def print_row(r: dict):
    med = f"{r['median_ms']:9.1f} ms" if r.get("median_ms") is not None else " " * 12
    extra = ""
    if r.get("rel_err") is not None:
        extra += f"  err {r['rel_err']:.1e}"
    if r.get("peak_mb") is not None:
        extra += f"  peak {r['peak_mb']:.0f} MB"
    why = f"  ({r['reason']})" if r.get("reason") and r["status"] != "ok" else ""
    print(f"{r['preset']:>5} {r['model']:>9} b{r['batch']:<2} {r['dtype']} {r['impl']:<13}{med}{extra}  {r['status']}{why}",
          flush=True)
