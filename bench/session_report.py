"""bench/gpu_session.sh's helper: what its steps' JSON files hold, read without importing torch (seconds count).

    python3 bench/session_report.py missing-forced KERNELS_JSON LABEL...   # the labels without a timed row
    python3 bench/session_report.py has-triton KERNELS_JSON forced|autotuned  # exit 0 when such a row was timed
    python3 bench/session_report.py summary OUT_DIR                         # the short table at the session's end

A file that a killed step never wrote, or that does not parse, counts as holding no rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_FILES = 8  # gpu_session.sh's design: a few result files, easy to copy back from a remote GPU machine


def rows_of(path: Path, key: str = "rows") -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    rows = data.get(key) if isinstance(data, dict) else None
    return rows if isinstance(rows, list) else []


def timed(row: dict) -> bool:
    return row.get("ms_median") is not None and not row.get("error")


def missing_forced(kernels_json: Path, labels: list[str]) -> list[str]:
    """The forced variants with no timed row (crashed, hung, failed or excluded): the ones to keep out of
    autotuning in the later steps."""
    ok = {row["impl"] for row in rows_of(kernels_json) if timed(row)}
    return [label for label in labels if f"triton[{label}]" not in ok]


def has_triton(kernels_json: Path, kind: str) -> bool:
    rows = [row for row in rows_of(kernels_json) if row.get("op") == "attention" and timed(row)]
    if kind == "forced":
        return any(row["impl"].startswith("triton[") for row in rows)
    return any(row["impl"] == "triton" for row in rows)


def fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def kernel_lines(rows: list[dict]) -> list[str]:
    """Per (op, pass, model, heads, D): the best Triton row against the best SDPA row."""
    cases: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if row.get("op") != "attention" or not timed(row):
            continue
        case = (row["pass"], row["model"], row["Hq"], row["Hkv"], row["D"])
        family = "triton" if row["impl"].startswith("triton") else row["impl"]
        best = cases.setdefault(case, {})
        if family not in best or row["ms_median"] < best[family]["ms_median"]:
            best[family] = row
    lines = []
    for (pas, model, hq, hkv, d), best in cases.items():
        sdpa = min((r for name, r in best.items() if name.startswith("sdpa") or name == "reference"),
                   key=lambda r: r["ms_median"], default=None)
        tri, auto = best.get("triton"), best.get("auto")
        lines.append(f"attention {pas:<7} {model:<5} Hq {hq} Hkv {hkv} D {d}: triton {fmt(tri and tri.get('TFLOP/s'))} "
                     f"TFLOP/s ({tri['impl'] if tri else '-'}), auto {fmt(auto and auto.get('TFLOP/s'))}, "
                     f"best SDPA {fmt(sdpa and sdpa.get('TFLOP/s'))} ({sdpa['impl'] if sdpa else '-'})")
    for row in rows:
        if row.get("op") == "qk_norm_rope" and row.get("impl") == "triton" and timed(row):
            lines.append(f"qk_norm_rope {row['model']} {row['dtype']}/{row.get('rope_dtype')}: "
                         f"{fmt(row.get('GB/s'))} GB/s = {fmt(row.get('frac_copy_bw'), '.0%')} of the copy")
    return lines


def e2e_lines(rows: list[dict]) -> list[str]:
    return [f"e2e {r['preset']} {r['model']} b{r['batch']} {r['dtype']} {r['impl']}: "
            f"{fmt(r.get('median_ms'), '.1f')} ms, "
            f"{fmt(r.get('speedup_vs_hf'), '.2f')}x hf, {fmt(r.get('speedup_vs_hf_compile'), '.2f')}x compile(hf), "
            f"rel err {fmt(r.get('rel_err'), '.1e')}, {r.get('status')}" for r in rows]


def pipeline_lines(rows: list[dict]) -> list[str]:
    return [f"pipeline {r['tasks']} {r['photo']} workers {r['workers']}: {r['real']['images_per_s']} img/s, "
            f"{r['of_model_alone']:.0%} of the model alone" for r in rows]


def summary(out: Path) -> list[str]:
    lines = kernel_lines(rows_of(out / "kernels.json"))
    lines += e2e_lines(rows_of(out / "e2e.json"))
    lines += pipeline_lines(rows_of(out / "pipeline.json", "real_rows"))
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    verdict = "ok" if len(files) <= MAX_FILES else f"OVER the {MAX_FILES} that come back"
    lines.append(f"{len(files)} files in {out} ({verdict}): {', '.join(files)}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "missing-forced":
        print(" ".join(missing_forced(Path(argv[1]), argv[2:])))
        return 0
    if len(argv) == 3 and argv[0] == "has-triton" and argv[2] in ("forced", "autotuned"):
        return 0 if has_triton(Path(argv[1]), argv[2]) else 1
    if len(argv) == 2 and argv[0] == "summary":
        print("\n".join(summary(Path(argv[1]))))
        return 0
    print("error: usage: bench/session_report.py missing-forced JSON LABEL... | has-triton JSON forced|autotuned | "
          "summary OUT_DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
