"""Plots of a run (or of a Hydra multirun sweep) from its ``metrics.jsonl``: PNGs plus one report.html.

``write_report(path)``: ``path`` is a run's output dir (holding ``metrics.jsonl``) or a sweep dir whose
sub-dirs are runs; a sweep's runs are overlaid on each chart, labelled by their Hydra overrides
(``.hydra/overrides.yaml``). Charts whose metrics no run logged (e.g. MFU and memory on CPU) are left out
and named in the page. The HTML embeds the PNGs, so the one file can be mailed or attached as it is.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_rl.logging import metric_names as names

METRICS_FILE = "metrics.jsonl"
REPORT_HTML = "report.html"
REPORT_DIR = "report"  # the PNGs, next to report.html


@dataclass(frozen=True)
class Chart:
    """One PNG: the exact metric ``keys`` and/or every metric starting with one of ``prefixes``."""

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    stacked: bool = False  # one run: stack the series (time per phase adds up to the step)

    def series(self, available: set[str]) -> list[str]:
        found = [k for k in self.keys if k in available]
        found += sorted(k for k in available if k.startswith(self.prefixes) and k not in found)
        return found


_PHASES = tuple(names.timing_key(p) for p in names.TIMING_PHASES if p != "step")
CHARTS = (
    Chart("score", "Score", "mean score", (names.SCORE_MEAN, names.VAL_SCORE_MEAN)),
    Chart("kl", "KL", "KL", (names.ACTOR_KL_LOSS, "actor/reference_kl", names.ACTOR_PPO_KL)),
    Chart("entropy", "Entropy", "nats / token", (names.ACTOR_ENTROPY,)),
    Chart(
        "response_length", "Response length", "tokens", (names.RESPONSE_LENGTH_MEAN, "response_length/max")
    ),
    Chart("timing", "Step time by phase", "seconds", _PHASES, stacked=True),
    Chart("throughput", "Throughput", "tokens / s / GPU", (names.PERF_THROUGHPUT,)),
    Chart("mfu", "MFU (update phase)", "fraction of peak", (names.PERF_MFU,)),
    Chart("memory", "Peak memory per phase", "GiB", prefixes=(names.PERF_MAX_MEMORY_ALLOCATED_GB + "/",)),
    Chart("reward_extra", "Extra reward terms", "mean", prefixes=("reward/", "reward_extra/")),
)


@dataclass
class Run:
    label: str
    path: Path
    rows: list[dict]

    def keys(self) -> set[str]:
        return {k for row in self.rows for k in row if k != "step"}

    def points(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in self.rows if key in r and math.isfinite(r[key])]
        return [s for s, _ in pts], [v for _, v in pts]


@dataclass
class Report:
    html: Path
    pngs: dict[str, Path] = field(default_factory=dict)
    series: dict[str, list[str]] = field(default_factory=dict)  # chart -> legend labels it drew
    skipped: list[str] = field(default_factory=list)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a resumed run repeats steps: the last row of a step wins."""
    by_step: dict[int, dict] = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # a run killed mid-write leaves a partial last line
            raise ValueError(
                f"{path}:{number} is not a JSON object; {METRICS_FILE} holds one per line"
            ) from None
        by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def _overrides_label(run_dir: Path) -> str | None:
    file = run_dir / ".hydra" / "overrides.yaml"
    if not file.is_file():
        return None
    overrides = yaml.safe_load(file.read_text()) or []
    shown = [o for o in overrides if not str(o).lstrip("+").startswith(("trainer.output_dir=", "hydra."))]
    return ", ".join(map(str, shown)) or None


def find_runs(path: str | Path) -> list[Run]:
    """The run at ``path``, or the runs under it (a sweep dir: ``<sweep>/<n>/metrics.jsonl``)."""
    root = Path(path)
    if (root / METRICS_FILE).is_file():
        dirs = [root]
    else:
        dirs = sorted((p.parent for p in root.glob(f"*/{METRICS_FILE}")), key=lambda p: (len(p.name), p.name))
    if not dirs:
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {root} or its sub-directories; pass a run's trainer.output_dir (with "
            "the jsonl logger in trainer.logger) or a multirun sweep directory"
        )
    runs = [Run(_overrides_label(d) or d.name, d, read_metrics(d / METRICS_FILE)) for d in dirs]
    if len(runs) > 1 and len({r.label for r in runs}) < len(runs):
        for r in runs:
            r.label = f"{r.path.name}: {r.label}"
    return runs


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.2), dpi=110)
    FigureCanvasAgg(fig)  # no pyplot: no global state, no display needed
    return fig


def _short(key: str, chart: Chart) -> str:
    for prefix in chart.prefixes:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key.removeprefix(names.TIMING_PREFIX)


def plot_chart(chart: Chart, runs: list[Run], out: Path) -> list[str] | None:
    """Draw ``chart`` for ``runs`` into ``out`` (PNG); the legend labels drawn, or None without data."""
    series = chart.series(set().union(*(r.keys() for r in runs)))
    if not series:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    if chart.stacked and len(runs) == 1:
        present = [(k, *runs[0].points(k)) for k in series]
        steps = sorted({s for _, xs, _ in present for s in xs})
        stacks = [[dict(zip(xs, ys)).get(s, 0.0) for s in steps] for _, xs, ys in present]
        ax.stackplot(steps, *stacks, labels=[_short(k, chart) for k, _, _ in present], alpha=0.85)
        xs, ys = runs[0].points(names.TIMING_STEP)  # the total: the gap above the stack is untimed work
        if xs:
            ax.plot(xs, ys, color="black", linewidth=1.2, label="step (total)")
    else:
        styles = ("-", "--", ":", "-.")
        for r, run in enumerate(runs):
            keys = [names.TIMING_STEP] if chart.stacked else series  # sweeps: total step time per run
            for i, key in enumerate(keys):
                xs, ys = run.points(key)
                if not xs:
                    continue
                # one run: a colour per metric; a sweep: a colour per run, a line style per metric
                style = (
                    dict(color=f"C{i % 10}")
                    if len(runs) == 1
                    else dict(color=f"C{r % 10}", linestyle=styles[i % 4])
                )
                label = _short(key, chart) if len(runs) == 1 else f"{_short(key, chart)} [{run.label}]"
                marker = "o" if len(xs) < 30 or key == names.VAL_SCORE_MEAN else None
                ax.plot(xs, ys, label=label, marker=marker, markersize=3, linewidth=1.4, **style)
    ax.set_title(chart.title)
    ax.set_xlabel("step")
    ax.set_ylabel(chart.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out)
    return ax.get_legend_handles_labels()[1]


def _summary_rows(runs: list[Run]) -> str:
    keys = (names.VAL_SCORE_MEAN, names.SCORE_MEAN, names.TIMING_STEP, names.PERF_THROUGHPUT)
    head = "<tr><th>run</th><th>steps</th>" + "".join(f"<th>last {html.escape(k)}</th>" for k in keys)
    body = []
    for run in runs:
        last = [run.points(k)[1][-1:] for k in keys]
        cells = "".join(f"<td>{v[0]:.4g}</td>" if v else "<td>-</td>" for v in last)
        steps = run.rows[-1]["step"] if run.rows else 0
        body.append(f"<tr><td>{html.escape(run.label)}</td><td>{steps}</td>{cells}</tr>")
    return f"<table>{head}</tr>{''.join(body)}</table>"


def write_report(path: str | Path, output: str | Path | None = None) -> Report:
    """Write ``<output>/report.html`` and ``<output>/report/<chart>.png`` (``output`` defaults to
    ``path``) for the run or sweep at ``path``."""
    runs = find_runs(path)
    out = Path(output or path)
    (out / REPORT_DIR).mkdir(parents=True, exist_ok=True)
    report = Report(out / REPORT_HTML)
    sections = []
    for chart in CHARTS:
        png = out / REPORT_DIR / f"{chart.name}.png"
        labels = plot_chart(chart, runs, png)
        if labels is None:
            report.skipped.append(chart.name)
            continue
        report.pngs[chart.name], report.series[chart.name] = png, labels
        data = base64.b64encode(png.read_bytes()).decode()
        sections.append(
            f'<h2>{html.escape(chart.title)}</h2><img alt="{chart.name}" src="data:image/png;base64,{data}">'
        )
    skipped = ", ".join(c.name for c in CHARTS if c.name in report.skipped) or "none"
    title = html.escape(str(Path(path).resolve()))
    report.html.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>megatron_rl report: {title}</title>"
        "<style>body{font-family:sans-serif;max-width:900px;margin:auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}img{max-width:100%}</style></head><body>"
        f"<h1>megatron_rl report</h1><p>{title} ({len(runs)} run{'s' if len(runs) > 1 else ''})</p>"
        f"{_summary_rows(runs)}{''.join(sections)}<p>Charts without data in these runs: {skipped}.</p>"
        "</body></html>\n"
    )
    return report
