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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20.0)
    a = ap.parse_args()
    with open(a.trace) as f:
        print(json.dumps(device_gaps(json.load(f), a.min_us), indent=1))


if __name__ == "__main__":
    main()
