"""The main results as PNG figures, drawn from the JSON the studies write (`--out`).

python -m profiling.figures [--forward forward.json] [--attention attention.json]
    [--label-gather label_gather.json] [--compare cpu.json,gpu.json] [--out-dir docs/figures]

- `v6e_roofline.png`, from profiling.bench_forward (or profiling.v6e.forward_breakdown),
  bench_attention and bench_label_gather (each with its v6e estimate): each forward, attention shape and label gather (at its most
  rows) at its arithmetic intensity, the FLOP/s its v6e estimate implies, against v6e's
  roofline.
- `server_vs_hf.png`, from profiling.bench_compare runs (one series a file): the server's
  items/s over HuggingFace's with the query's KV reused, by shape.

A figure whose inputs are not given is not drawn. Needs matplotlib (`pip install -e
'.[figures]'`), which nothing else does.
"""
import json
import os

import numpy as np
from absl import app, flags

from profiling.v6e.roofline import V6E_FLOPS, V6E_HBM
from runtime.cli_flags import parse_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("forward", None, "profiling.bench_forward's JSON, with its estimate")
    flags.DEFINE_string("attention", None, "profiling.bench_attention's JSON, with its estimate")
    flags.DEFINE_string("label_gather", None, "profiling.bench_label_gather's JSON, with its "
                        "estimate")
    flags.DEFINE_list("compare", [], "profiling.bench_compare JSON files, one series each")
    flags.DEFINE_string("out_dir", "docs/figures", "where the PNG files go")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def roofline_points(forward: dict | None, attention: dict | None,
                    label_gather: dict | None = None, vocab: int = 151936) -> list[dict]:
    """(label, kind, FLOPs, HBM bytes, estimated seconds) of each estimated piece of work; the
    label gather's at its most rows and `vocab` (Qwen3's, whose heads the attention study
    uses)."""
    points = []
    for row in (forward or {}).get("buckets", []):
        est = row.get("v6e_estimate")
        if est:
            points.append(dict(label=f"{row['bucket']} tokens", kind="whole forward",
                               flops=est["flops"], bytes=est["hbm_bytes"], s=est["seconds"]))
    for row in (forward or {}).get("runs", []):  # profiling.v6e.forward_breakdown's
        points.append(dict(label=f"{row['bucket']} tokens", kind="whole forward",
                           flops=row["flops"], bytes=row["hbm_bytes"], s=row["seconds"]))
    for name, row in (attention or {}).get("shapes", {}).items():
        if "v6e_estimate_s" in row:
            points.append(dict(label=_shape_name(name), kind="attention kernel",
                               flops=row["flops"], bytes=row["hbm_bytes"],
                               s=row["v6e_estimate_s"]))
    cases = (label_gather or {}).get("cases", [])
    most = max((c["rows"] for c in cases), default=0)
    for case in (c for c in cases if c["rows"] == most and c["vocab"] == vocab):
        for mode, row in case["modes"].items():
            if "v6e_estimate_s" in row:
                points.append(dict(label=f"{mode.split('_')[0]}, {most} rows",
                                   kind="label gather", flops=row["flops"],
                                   bytes=row["hbm_bytes"], s=row["v6e_estimate_s"]))
    return points


def _shape_name(study_name: str) -> str:
    """bench_attention's shape names, short: mis_120q_64x18 -> 64 items; causal_4096 -> 4096
    causal."""
    parts = study_name.split("_")
    if parts[0] == "mis":
        return f"{parts[2].split('x')[0]} items"
    return " ".join(reversed(parts))


def draw_roofline(points: list[dict], title: str, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    intensity = np.array([p["flops"] / p["bytes"] for p in points])
    span = np.geomspace(min(intensity.min(), 1) / 2, max(intensity.max(), 2e3) * 2, 200)
    ax.plot(span, np.minimum(V6E_FLOPS, span * V6E_HBM), "k-", lw=1.5,
            label="v6e roofline (918 TFLOP/s, 1.64 TB/s)")
    for kind, marker in (("whole forward", "o"), ("attention kernel", "s"),
                         ("label gather", "^")):
        mine = [p for p in points if p["kind"] == kind]
        if not mine:
            continue
        x = [p["flops"] / p["bytes"] for p in mine]
        y = [p["flops"] / p["s"] for p in mine]
        ax.scatter(x, y, marker=marker, s=40, label=f"{kind}, v6e estimate")
        for i, (p, xi, yi) in enumerate(zip(mine, x, y)):
            share = min(V6E_FLOPS, xi * V6E_HBM)
            # the kernels' points cluster: their labels stack above and left, with a leader;
            # the forwards' alternate below and above, where two lie close
            offset = ((6, -12 if i % 2 == 0 else 8) if kind == "whole forward"
                      else (-95, 14 + 12 * i))
            ax.annotate(f"{p['label']}: {yi / share:.0%}", (xi, yi), fontsize=7,
                        xytext=offset, textcoords="offset points",
                        arrowprops=dict(arrowstyle="-", lw=0.4, color="grey"))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / HBM byte)",
           ylabel="FLOP/s (estimated)", title=title)
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speedups(result: dict) -> dict[str, float]:
    """The server's items/s over HuggingFace's with KV reuse, by shape."""
    return {name: row["hf_query_kv_reuse"]["server_speedup"]
            for name, row in result["shapes"].items() if "hf_query_kv_reuse" in row}


def draw_against_hf(series: dict[str, dict[str, float]], path: str) -> None:
    plt = _pyplot()
    shapes = list(dict.fromkeys(s for ratios in series.values() for s in ratios))
    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / len(series)
    for i, (label, ratios) in enumerate(series.items()):
        x = np.arange(len(shapes)) + (i - (len(series) - 1) / 2) * width
        ax.bar(x, [ratios.get(s, np.nan) for s in shapes], width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(shapes)), shapes, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="server items/s ÷ HuggingFace's\n(query KV reused)",
           title="The server against HuggingFace on SGLang's benchmark shapes")
    ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def series_label(result: dict, path: str) -> str:
    return result.get("label") or os.path.splitext(os.path.basename(path))[0]


def _load(path: str | None) -> dict | None:
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def main(argv) -> None:
    del argv
    for path in draw_all():
        print(path)


def draw_all() -> list[str]:
    """The figures the flags give inputs for; returns their paths."""
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    written = []
    forward, attention = _load(FLAGS.forward), _load(FLAGS.attention)
    points = roofline_points(forward, attention, _load(FLAGS.label_gather))
    if points:
        path = os.path.join(FLAGS.out_dir, "v6e_roofline.png")
        draw_roofline(points, "v6e estimates from the compiled schedules (a calibrated model), "
                      "bfloat16", path)
        written.append(path)
    if FLAGS.compare:
        series = {}
        for path in FLAGS.compare:
            result = _load(path)
            series[series_label(result, path)] = speedups(result)
        path = os.path.join(FLAGS.out_dir, "server_vs_hf.png")
        draw_against_hf(series, path)
        written.append(path)
    return written


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
