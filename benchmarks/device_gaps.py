"""Where the GPU idles in a profiled phase, and what the host was doing then (issue 16).

A phase's wall time minus its device time is time the device had nothing queued: the host was busy with
Python (bookkeeping between decode steps, building a micro-batch, reading metrics) or waited on something
else. ``device_gaps`` takes a torch.profiler chrome trace (``prof.export_chrome_trace``), merges the device's
kernel / copy / memset intervals over all streams, and reports the idle gaps of at least ``min_us`` with
the innermost host annotation (``torch.profiler.record_function`` ranges, e.g. the engine's
``rollout.retire``; see ``megatron_rl.logging.timer.annotate``) and the innermost host op open at each
gap's middle: idle time by host phase.

    python benchmarks/device_gaps.py trace.json [--min-us 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _spans(events: list[dict], cats: set[str]) -> list[tuple[float, float, str]]:
    return sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in cats
    )


def _open_at(events: list[dict], cat: str, times: list[float]) -> list[dict]:
    """For each of the sorted ``times``: per host thread, the innermost ``cat`` span open then (a sweep with
    one stack per (pid, tid): a thread's ranges nest) -> [{thread: (start, name)}]."""
    threads: dict[tuple, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == cat:
            a = float(e["ts"])
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(
                (a, a + float(e.get("dur", 0.0)), e.get("name", ""))
            )
    out: list[dict] = [{} for _ in times]
    for thread, spans in threads.items():
        spans.sort(key=lambda s: (s[0], -s[1]))  # a parent before the children starting with it
        stack: list[tuple[float, float, str]] = []
        i = 0
        for k, t in enumerate(times):
            while i < len(spans) and spans[i][0] <= t:
                while stack and stack[-1][1] < spans[i][0]:
                    stack.pop()
                stack.append(spans[i])
                i += 1
            while stack and stack[-1][1] < t:
                stack.pop()
            if stack:
                out[k][thread] = (stack[-1][0], stack[-1][2])
    return out


def _latest(open_spans: dict, thread=None) -> tuple[object, str | None]:
    """(thread, name) of the latest-starting open span, or of ``thread``'s when given."""
    if thread is not None:
        return thread, open_spans.get(thread, (None, None))[1]
    if not open_spans:
        return None, None
    thread, (_, name) = max(open_spans.items(), key=lambda kv: kv[1][0])
    return thread, name


def device_gaps(trace: dict | list, min_us: float = 20.0, top: int = 25) -> dict:
    """Idle gaps of the device in a chrome trace: the window (first to last event of any kind), the device's
    busy time (union of its intervals), the gaps >= ``min_us`` (before the first device interval, between
    two, after the last) summed by the innermost host annotation open at their middle, and the ``top``
    longest with that annotation and the innermost host op (times in us)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    windowed = {"cpu_op", "user_annotation", *DEVICE_CATS}  # not the profiler's own spans
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e and e.get("cat") in windowed]
    if not timed:
        return {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": 0, "idle_in_gaps_us": 0.0,
                "by_annotation": {}, "top": []}  # fmt: skip
    t0 = min(float(e["ts"]) for e in timed)
    t1 = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in timed)
    busy: list[list[float]] = []
    for a, b, _ in _spans(events, DEVICE_CATS):
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    edges = [t0] + [x for iv in busy for x in iv] + [t1]
    holes = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] - edges[i] >= min_us]
    mids = [(a + b) / 2 for a, b in holes]
    notes, ops = _open_at(events, "user_annotation", mids), _open_at(events, "cpu_op", mids)
    by: dict[str, list[float]] = {}
    found = []
    for (a, b), note_open, op_open in zip(holes, notes, ops):
        thread, note = _latest(note_open)
        _, op = _latest(op_open, thread) if thread is not None and thread in op_open else _latest(op_open)
        note = note or "(no annotation)"
        entry = by.setdefault(note, [0, 0.0])
        entry[0] += 1
        entry[1] += b - a
        found.append({"start_us": a - t0, "us": b - a, "annotation": note, "host_op": op})
    busy_us = sum(b - a for a, b in busy)
    return {
        "window_us": t1 - t0,
        "busy_us": busy_us,
        "idle_us": t1 - t0 - busy_us,
        "gaps": len(holes),
        "idle_in_gaps_us": sum(b - a for a, b in holes),
        "by_annotation": {
            k: {"gaps": int(n), "us": us} for k, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])
        },
        "top": sorted(found, key=lambda g: -g["us"])[:top],
    }


def split_steps(events: list[dict]) -> dict:
    """A chrome trace's kernels split by launch (``decode_step_parts.py``): kernels whose correlation id is a
    ``cudaGraphLaunch``'s are that replay's, the others eager. Each replay and the eager kernels that start
    between its last kernel's end and the next replay's first kernel make one step -> the number of steps
    (replays but the last), per-step medians (graph span / busy us / kernels, tail gap / busy us / kernels,
    step us) and per-name kernel times (us a step, by replay and tail)."""
    graph_ids = {
        e["args"]["correlation"]
        for e in events
        if e.get("cat") == "cuda_runtime"
        and e.get("name") == "cudaGraphLaunch"
        and "correlation" in e.get("args", {})
    }
    kernels = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""),
         e.get("args", {}).get("correlation") in graph_ids, e.get("args", {}).get("correlation"))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "kernel"
    )  # fmt: skip
    replays: dict[int, list] = defaultdict(list)
    for k in kernels:
        if k[3]:
            replays[k[4]].append(k)
    spans = sorted((min(k[0] for k in ks), max(k[1] for k in ks), ks) for ks in replays.values())
    steps = []
    graph_names: dict[str, float] = defaultdict(float)
    tail_names: dict[str, float] = defaultdict(float)
    for (a, b, ks), (a2, _, _) in zip(spans, spans[1:]):
        tail = [k for k in kernels if not k[3] and b <= k[0] < a2]
        steps.append({
            "graph_span_us": b - a, "graph_busy_us": sum(k[1] - k[0] for k in ks), "graph_kernels": len(ks),
            "tail_gap_us": a2 - b, "tail_busy_us": sum(k[1] - k[0] for k in tail), "tail_kernels": len(tail),
            "step_us": a2 - a,
        })  # fmt: skip
        for k in ks:
            graph_names[k[2][:90]] += k[1] - k[0]
        for k in tail:
            tail_names[k[2][:90]] += k[1] - k[0]
    n = max(1, len(steps))
    med = {key: statistics.median(s[key] for s in steps) for key in steps[0]} if steps else {}
    per = lambda d: dict(sorted(((k, v / n) for k, v in d.items()), key=lambda kv: -kv[1]))  # noqa: E731
    return {
        "steps": len(steps),
        "median": med,
        "graph_kernels_us": per(graph_names),
        "tail_kernels_us": per(tail_names),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20.0)
    a = ap.parse_args()
    with open(a.trace) as f:
        print(json.dumps(device_gaps(json.load(f), a.min_us), indent=1))


if __name__ == "__main__":
    main()
