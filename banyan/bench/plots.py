"""PNG plots of a compare run, drawn with matplotlib when it is installed (pip install banyan[bench]).

    NAME-throughput.png  serve: output tokens/s against concurrent streams, one line per engine
    NAME-latency.png     CDFs at the judged streams: TTFT and ITL of the serve sweep, TTFT of multi-turn
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

CDF_PANELS = (("serve", "ttft_ms", "TTFT, serve"), ("serve", "itl_ms_percentiles", "ITL, serve"),
              ("multi-turn", "ttft_ms", "TTFT, multi-turn"))


def write_plots(runs: list[dict], streams: int, out_dir: Path, name: str) -> list[Path]:
    """The plots' paths; none without matplotlib (said once on stderr)."""
    if importlib.util.find_spec("matplotlib") is None:
        import sys

        print("compare: no plots (matplotlib is not installed: pip install 'banyan[bench]')", file=sys.stderr)
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    ok = [r for r in runs if not r["error"]]
    return [_throughput(ok, out_dir / f"{name}-throughput.png"), _latency_cdfs(ok, streams, out_dir / f"{name}-latency.png")]


def _throughput(runs: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, points in _by_engine(r for r in runs if r["scenario"] == "serve").items():
        points.sort(key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in points], [r["metrics"]["output_throughput"] for r in points], "o-", label=engine)
    ax.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s", title="Serving throughput", ylim=(0, None))
    ax.set_xticks(sorted({r["concurrency"] for r in runs if r["scenario"] == "serve"}) or [1])
    ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def _latency_cdfs(runs: list[dict], streams: int, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CDF_PANELS), figsize=(5 * len(CDF_PANELS), 4))
    for ax, (scenario, key, title) in zip(axes, CDF_PANELS):
        chosen = [r for r in runs if r["scenario"] == scenario and (scenario != "serve" or r["concurrency"] == streams)]
        for run in chosen:
            values = sorted(run["metrics"].get("samples", {}).get(key) or [])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=run["engine"])
        suffix = f" ({streams} streams)" if scenario == "serve" else ""
        ax.set(xlabel="ms", ylabel="fraction of requests" if key != "itl_ms_percentiles" else "fraction of gaps",
               title=title + suffix, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, path)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # a panel may have nothing yet (a report after the first stage)
        ax.legend()


def _by_engine(runs) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for run in runs:
        grouped.setdefault(run["engine"], []).append(run)
    return grouped


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
