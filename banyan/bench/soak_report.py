"""The soak's report: markdown (figures, goals met or not) and an SVG plot drawn by hand (no plotting library):
RSS of the server and the engine core, and KV pages in use, over the soak."""

from __future__ import annotations

from pathlib import Path

from banyan.kernels.cpu_features import isa

WIDTH, HEIGHT, PAD = 720, 300, 48
SERIES = (("server_rss", "server RSS (MiB)", "#1f77b4", 2**20), ("core_rss", "engine core RSS (MiB)", "#d62728", 2**20))


def markdown(report: dict) -> str:
    results = report["results"]
    s, machine = results["soak"], report.get("machine", {})
    cfg = results["config"]
    lines = [f"# banyan bench soak: {cfg['streams']} streams x {cfg['minutes']:g} min",
             "", f"Machine: {machine.get('cpu', '?')} ({machine.get('isa') or isa()}), {machine.get('num_cpus', '?')} CPUs. "
             f"Model: {report['config'].get('model')}.",
             "", "| goal | met |", "|---|---|"]
    lines += [f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in results["goals"].items()]
    lines += ["", "| soak figure | value |", "|---|---|"]
    for key in ("duration_s", "requests", "checked", "left_on_purpose", "lost", "mangled", "http_5xx", "error_events",
                "status_counts", "completion_tokens", "integrity_failures", "kv_unanswered", "server_rss_mib", "server_rss_growth",
                "server_fds", "server_threads", "core_rss_mib", "core_rss_growth", "core_fds", "core_threads"):
        if key in s:
            lines.append(f"| {key} | {_fmt(s[key])} |")
    if "storm" in results:
        lines += ["", "| storm figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in results["storm"].items()]
    for name, figures in results.get("faults", {}).items():
        lines += ["", f"| fault: {name} | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in figures.items()]
    if s.get("examples"):
        lines += ["", "Examples of what failed:", ""] + [f"- `{e}`" for e in s["examples"]]
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "none"
    return str(value)


def write_svg(samples: list[dict], path: Path) -> Path:
    """Lines of RSS (left axis, MiB) and KV pages in use (right axis, % of the pool) against seconds."""
    points = [s for s in samples if "server_rss" in s]
    t_max = max((s["t"] for s in points), default=1.0) or 1.0
    top = max((s.get(key, 0) / scale for s in points for key, _, _, scale in SERIES), default=1.0) * 1.1 or 1.0
    x = lambda t: PAD + (WIDTH - 2 * PAD) * t / t_max  # noqa: E731
    y = lambda v, vmax: HEIGHT - PAD - (HEIGHT - 2 * PAD) * v / vmax  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
             f'<text x="{WIDTH / 2}" y="{HEIGHT - 12}" text-anchor="middle">seconds (0 - {t_max:.0f})</text>',
             f'<text x="8" y="{PAD - 10}">MiB (0 - {top:.0f})</text>',
             f'<text x="{WIDTH - PAD}" y="{PAD - 10}" text-anchor="end">KV in use, % (0 - 100)</text>']
    legend = [*SERIES, ("kv", "KV pages in use (%)", "#2ca02c", None)]
    for key, label, color, scale in legend:
        if key == "kv":
            pts = [(x(s["t"]), y(100 * s["kv_in_use"] / max(1, s["kv_pages"]), 100)) for s in points if "kv_pages" in s]
        else:
            pts = [(x(s["t"]), y(s[key] / scale, top)) for s in points if key in s]
        if pts:
            path_d = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path_d}"/>')
    for i, (_, label, color, _) in enumerate(legend):
        parts.append(f'<text x="{PAD + 10}" y="{PAD + 14 * (i + 1)}" fill="{color}">{label}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path
