"""Plot every ``benchmarks/results/<name>.csv`` to ``<name>.png``: for the newest commit in each
file, our value and the baseline's per case (bars), with the ratio written above each pair."""

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
    if not rows:
        return None
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


def main(paths):
    for path in paths or sorted(glob.glob(os.path.join(RESULTS, "*.csv"))):
        print(plot(path))


if __name__ == "__main__":
    main(sys.argv[1:])
