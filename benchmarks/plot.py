"""Plot every ``benchmarks/results/<name>.csv`` to ``<name>.png``: for the newest commit in each
file, our value and the baseline's per case (bars), with the ratio written above each pair.

    python benchmarks/plot.py [CSV ...]
    python benchmarks/plot.py --compare OLD NEW CASE CSV     # -> <name>_OLD_NEW.png

``--compare``: the ratio to the baseline of one case (e.g. "small M heuristic") per shape at two
commits side by side (a change's before and after, measured in one run)."""

import csv
import glob
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def plot(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"case", "ours_value", "baseline_value"} <= rows[0].keys():
        return None   # empty, or a probe's own columns (quant_stream.csv and the like)
    newest = rows[-1]["commit"]
    rows = [r for r in rows if r["commit"] == newest]
    labels = [f"{r['case']}\n{r['dtype']}" for r in rows]
    ours = [float(r["ours_value"]) for r in rows]
    base = [float(r["baseline_value"] or "nan") for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], ours, 0.4, label="llmspeed_numba")
    ax.bar([i + 0.2 for i in x], base, 0.4, label=rows[0]["baseline"])
    for i, r in enumerate(rows):
        ax.text(i, max(ours[i], base[i] if base[i] == base[i] else 0), f"{float(r['ratio']):.2f}",
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel(rows[0]["unit"])
    ax.set_title(f"{os.path.basename(path)[:-4]} on {rows[0]['gpu']} @ {newest} (ratio above)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = path[:-4] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def compare(old, new, case, path):
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["case"] == case]
    for commit in (old, new):
        if not any(r["commit"] == commit for r in rows):
            raise SystemExit(f"{path}: no {case!r} rows of commit {commit}")
    ratio = {(r["commit"], r["shape"], r["dtype"]): float(r["ratio"]) for r in rows}
    shapes = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rows if r["commit"] == new))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(shapes)), 4.5))
    for offset, commit in ((-0.2, old), (0.2, new)):
        values = [ratio.get((commit, *s), float("nan")) for s in shapes]
        ax.bar([i + offset for i in range(len(shapes))], values, 0.4, label=commit)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"{s} {d}" for s, d in shapes], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"ratio to {rows[0]['baseline']}" if rows else "ratio")
    ax.set_title(f"{os.path.basename(path)[:-4]}: {case}, {old} vs {new}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = f"{path[:-4]}_{old}_{new}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv):
    if argv[:1] == ["--compare"]:
        if len(argv) != 5:
            raise SystemExit("usage: plot.py --compare OLD NEW CASE CSV")
        print(compare(*argv[1:]))
        return
    for path in argv or sorted(glob.glob(os.path.join(RESULTS, "*.csv"))):
        print(plot(path))


if __name__ == "__main__":
    main(sys.argv[1:])
