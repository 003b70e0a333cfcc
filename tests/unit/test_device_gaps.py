"""``benchmarks/device_gaps.py``: the device's idle gaps in a profiler trace, by the host annotation open then."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from device_gaps import device_gaps, split_steps  # noqa: E402


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_gaps_are_summed_by_the_innermost_annotation_at_their_middle():
    trace = {
        "traceEvents": [
            _x("user_annotation", "rollout.generate", 0, 1000),
            _x("user_annotation", "rollout.retire", 300, 150),  # nested: the innermost wins
            _x("cpu_op", "aten::tolist", 310, 40),
            _x("kernel", "k1", 10, 100),
            _x("kernel", "k2", 50, 200),  # overlaps k1 (another stream): one busy interval 10..250
            _x("gpu_memcpy", "copy", 250, 50),  # touches it: 10..300
            _x("kernel", "k3", 400, 100),  # gap 300..400 (100 us) inside retire
            _x("kernel", "k4", 505, 95),  # gap of 5 us: under min_us
            _x("kernel", "k5", 900, 100),  # gap 600..900 (300 us) inside generate only
            {"ph": "i", "cat": "instant", "name": "marker", "ts": 5},  # not a span: ignored
        ]
    }
    g = device_gaps(trace, min_us=20)
    assert g["window_us"] == 1000 and g["busy_us"] == 290 + 100 + 95 + 100
    assert g["idle_us"] == 1000 - g["busy_us"]
    assert g["gaps"] == 2  # 300..400 and 600..900; the leading 0..10 and 500..505 are under 20 us
    assert g["by_annotation"]["rollout.retire"] == {"gaps": 1, "us": 100}
    assert g["by_annotation"]["rollout.generate"]["us"] == 300
    top = g["top"][0]
    assert top["us"] == 300 and top["annotation"] == "rollout.generate" and top["host_op"] is None
    retire = next(t for t in g["top"] if t["annotation"] == "rollout.retire")
    assert retire["host_op"] == "aten::tolist" and retire["start_us"] == 300


def test_a_trace_without_device_work_is_one_idle_window():
    g = device_gaps([_x("cpu_op", "aten::add", 0, 50)], min_us=10)
    assert g["busy_us"] == 0 and g["idle_us"] == 50 and g["gaps"] == 1
    assert g["by_annotation"] == {"(no annotation)": {"gaps": 1, "us": 50}}
    assert device_gaps({"traceEvents": []})["gaps"] == 0


def test_an_outer_annotation_is_found_past_many_inner_spans_and_ops_come_from_its_thread():
    """A gap after 5,000 decode steps is still inside the outer phase; the host op is the one open on the thread
    of the annotation, not a later-starting op of another thread (autograd's)."""
    main = {"pid": 1, "tid": 1}
    events = [_x("user_annotation", "phase.gen", 0, 100_000) | main]
    for i in range(5000):  # 5,000 inner annotations, each with a kernel under it
        events.append(_x("user_annotation", "rollout.decode_step", 10 + 10 * i, 5) | main)
        events.append(_x("kernel", "k", 10 + 10 * i, 10))
    events.append(_x("cpu_op", "aten::sort", 60_000, 30_000) | main)  # the gap 50,010..99,000: host sorting
    events.append(
        _x("cpu_op", "autograd::engine", 74_000, 1_000) | {"pid": 1, "tid": 2}
    )  # open at the middle
    events.append(_x("kernel", "k_last", 99_000, 1_000))
    g = device_gaps({"traceEvents": events}, min_us=20)
    assert g["gaps"] == 1
    (gap,) = g["top"]
    assert (
        gap["annotation"] == "phase.gen" and gap["host_op"] == "aten::sort" and gap["us"] == 99_000 - 50_010
    )


def _k(name, ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(name, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": 0, "dur": 1, "args": {"correlation": corr}}


def test_split_steps_separates_graph_replays_from_the_eager_kernels_after_them():
    events = [_launch("cudaGraphLaunch", 1), _launch("cudaGraphLaunch", 2), _launch("cudaGraphLaunch", 3)]
    events += [_launch("cudaLaunchKernel", c) for c in (10, 11, 12)]
    for step, t0 in enumerate((0, 200, 400)):  # a replay of two kernels (0..100), then eager kernels
        events += [_k("gemm", t0, 60, step + 1), _k("attn", t0 + 70, 30, step + 1)]
        if step < 2:
            events += [_k("draw", t0 + 120, 20, 10 + step)]
    events.append(_k("record", 250 + 120, 10, 12))  # step 1's tail has two eager kernels
    got = split_steps(events)
    assert got["steps"] == 2  # the last replay has no next one to close its tail
    med = got["median"]
    assert med["graph_span_us"] == 100 and med["graph_busy_us"] == 90 and med["graph_kernels"] == 2
    assert med["tail_gap_us"] == 100 and med["step_us"] == 200
    assert med["tail_kernels"] == 1.5  # 1 and 2 kernels: the median
    assert got["graph_kernels_us"] == {"gemm": 60.0, "attn": 30.0}
    assert got["tail_kernels_us"] == {"draw": 20.0, "record": 5.0}
