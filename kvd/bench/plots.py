"""The benchmarks' figures (matplotlib, the optional ``kvd[plot]`` extra).

``step_distribution``: ``kvd bench --plot``, the decode step's latency distribution per client count
beside the zmq echo and the in-process manager. ``scaling``: ``kvd bench --scale --plot``, step time
against R on log-log axes, one line per column of the scaling table.
"""

from __future__ import annotations

import sys

import numpy as np

PLOT_HINT = "pip install 'kvd[plot]' (or pip install matplotlib)"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on a server), or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _require():
    plt = pyplot()
    if plt is None:
        raise SystemExit(f"--plot needs matplotlib: {PLOT_HINT}")
    return plt


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)


def step_distribution(path: str, samples: dict, floor: dict | None, inproc: dict | None) -> None:
    plt = _require()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    allv = np.concatenate([np.asarray(v) * 1e6 for v in samples.values()] +
                          [np.asarray(x["_samples"]) * 1e6 for x in (floor, inproc) if x])
    bins = np.geomspace(max(allv.min() * 0.9, 1.0), allv.max() * 1.1, 80)
    for n, v in samples.items():
        ax.hist(np.asarray(v) * 1e6, bins=bins, histtype="step", density=True, linewidth=1.5,
                label=f"kvd, {n} client(s): p50 {np.percentile(v, 50) * 1e6:.0f} us, p99 {np.percentile(v, 99) * 1e6:.0f} us")
    for name, x in (("zmq echo", floor), ("in-process manager", inproc)):
        if x:
            v = np.asarray(x["_samples"]) * 1e6
            ax.hist(v, bins=bins, histtype="step", density=True, linestyle="--",
                    label=f"{name}: p50 {np.percentile(v, 50):.0f} us")
    ax.set_xscale("log")
    ax.set_xlabel("decode step round trip (us, log scale)")
    ax.set_ylabel("density")
    ax.set_title("kvd decode step latency (standard workload)")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def scaling(path: str, table: dict, columns: list[tuple[str, str]], target_key: str = "") -> None:
    """``table``: {R: row}; ``columns``: (row key prefix, label), each drawn from ``<prefix>_p50_us``
    (solid) and ``<prefix>_p99_us`` (dotted); a column whose p50 is None (n/a) is left out.
    ``target_key``: a row figure drawn as the dashed target line."""
    plt = _require()
    rs = sorted(table, key=int)
    x = [int(r) for r in rs]
    fig, ax = plt.subplots(figsize=(10, 5))
    for prefix, label in columns:
        p50 = [table[r].get(f"{prefix}_p50_us") for r in rs]
        if any(v is None for v in p50):
            continue
        p99 = [table[r][f"{prefix}_p99_us"] for r in rs]
        (line,) = ax.plot(x, p50, marker="o", linewidth=1.8, label=label)
        ax.plot(x, p99, linestyle=":", color=line.get_color(), linewidth=1.2)
    if target_key:
        ax.plot(x, [table[r][target_key] for r in rs], linestyle="--", color="grey",
                label="daemon target: echo + in-process + 25 us + 5 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{v:,}" for v in x])
    ax.minorticks_off()
    ax.set_xlabel("requests per client R (log scale)")
    ax.set_ylabel("decode step, us (solid p50, dotted p99; log scale)")
    ax.set_title("decode step time against R (1 client)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(plt, fig, path)
