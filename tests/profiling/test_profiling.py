"""mlx_trio/profiling: job-log aggregation, /proc stat parsing, stack-sample counting, windows and the env hook."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlx_trio import profiling
from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.profiling import thread_cpu
from mlx_trio.profiling.jobs import JobStats, percentile
from mlx_trio.profiling.recorder import Profiler, per_unit_us
from mlx_trio.profiling.stacks import StackCounts


def test_job_stats_count_total_and_nearest_rank_percentiles_per_name() -> None:
    stats = JobStats(window_start=10.0)
    steps = [("DecodeStepActor._link", 10.0 + i, 10.0 + i + ms / 1e3) for i, ms in enumerate(range(1, 21))]
    stats.add([*steps, ("PrefillActor._chunk", 40.0, 40.5)])
    summary = stats.summary()
    assert list(summary) == ["PrefillActor._chunk", "DecodeStepActor._link"]  # the largest total first
    link = summary["DecodeStepActor._link"]
    assert link["count"] == 20
    assert link["total_s"] == pytest.approx(sum(range(1, 21)) / 1e3)
    # 20 values 1..20 ms: nearest rank of q*(n-1): p50 -> index 10 (11 ms), p95 -> index 18 (19 ms).
    assert (link["p50_ms"], link["p95_ms"], link["max_ms"]) == pytest.approx((11.0, 19.0, 20.0))
    assert stats.count == 21
    assert stats.busy_s == pytest.approx(sum(range(1, 21)) / 1e3 + 0.5)


def test_a_job_that_started_before_the_window_counts_only_its_time_inside() -> None:
    stats = JobStats(window_start=5.0)
    stats.add([("a", 4.0, 5.25), ("b", 6.0, 6.5)])
    assert stats.busy_s == pytest.approx(0.75)
    assert stats.summary()["a"]["total_s"] == pytest.approx(1.25)  # the job's own duration is not clipped


def test_percentile_of_nothing_is_zero() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0], 0.95) == 3.0


def test_parse_stat_reads_utime_plus_stime_and_a_comm_with_spaces_and_parens() -> None:
    fields = ["S", *map(str, range(4, 14)), "250", "50", *map(str, range(16, 53))]  # utime 250, stime 50 ticks
    task = thread_cpu.parse_stat(f"4242 (gpu (lease) 1) {' '.join(fields)}\n", tick_s=0.01)
    assert (task.tid, task.comm, task.cpu_s) == (4242, "gpu (lease) 1", pytest.approx(3.0))
    with pytest.raises(ValueError):
        thread_cpu.parse_stat("garbage")


def _stat(tid: int, comm: str, ticks: int) -> str:
    return f"{tid} ({comm}) S " + " ".join(["0"] * 10) + f" {ticks} 0 " + " ".join(["0"] * 30)


def test_tasks_and_cpu_by_name_read_a_proc_tree_and_sum_per_name(tmp_path: Path) -> None:
    def write(ticks: dict[int, tuple[str, int]]) -> dict[int, thread_cpu.TaskCpu]:
        for tid, (comm, n) in ticks.items():
            (tmp_path / "7" / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
            (tmp_path / "7" / "task" / str(tid) / "stat").write_text(_stat(tid, comm, n))
        return thread_cpu.tasks(7, proc=tmp_path)

    start = write({7: ("python", 100), 8: ("python", 10)})
    assert set(start) == {7, 8}
    end = write({7: ("python", 150), 8: ("python", 40), 9: ("python", 5)})  # 9 was born in between
    usage = thread_cpu.cpu_by_name(start, end, {7: "MainThread", 8: "gpu-lease"})
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert usage["MainThread"] == {"cpu_s": pytest.approx(50 * tick), "threads": 1}
    assert usage["gpu-lease"] == {"cpu_s": pytest.approx(30 * tick), "threads": 1}
    assert usage["python"] == {"cpu_s": pytest.approx(5 * tick), "threads": 1}  # no Python name: its comm
    assert [n for n, _ in thread_cpu.top_threads(usage, ["gpu-lease"])] == ["gpu-lease", "MainThread", "python"]
    assert thread_cpu.tasks(99, proc=tmp_path) == {}


def _code(name: str, line: int) -> SimpleNamespace:
    return SimpleNamespace(co_qualname=name, co_name=name.rsplit(".", 1)[-1], co_filename=f"/x/{name}.py",
                           co_firstlineno=line)


def _stack(*names: str) -> SimpleNamespace:
    """A synthetic frame chain, outermost first: the last name is the leaf."""
    frame = None
    for i, name in enumerate(names):
        frame = SimpleNamespace(f_code=_code(name, i + 1), f_back=frame)
    return frame


def test_stack_counts_count_the_leaf_as_self_and_every_distinct_function_once_as_cumulative() -> None:
    counts = StackCounts()
    counts.add(_stack("main", "serve", "step", "sample"))
    counts.add(_stack("main", "serve", "step"))
    counts.add(_stack("main", "recurse", "recurse", "recurse"))  # recursion counts once per sample
    counts.add(None)  # a thread with no Python frame: no sample
    top = counts.top(10)
    assert top["samples"] == 3
    assert dict(top["self"]) == {"sample (sample.py:4)": 1, "step (step.py:3)": 1, "recurse (recurse.py:4)": 1}
    cumulative = dict(top["cumulative"])
    assert cumulative["main (main.py:1)"] == 3
    assert cumulative["serve (serve.py:2)"] == 2 and cumulative["step (step.py:3)"] == 2
    assert sum(v for k, v in cumulative.items() if k.startswith("recurse")) == 3  # three code objects, one each


def test_per_unit_costs_divide_each_thread_cpu_by_the_counts() -> None:
    threads = {"gpu-lease": {"cpu_s": 2.0, "threads": 1}, "MainThread": {"cpu_s": 0.5, "threads": 1}}
    per = per_unit_us(threads, {"tokens": 1000, "steps": 100, "lease_jobs": 50, "requests": 0})
    assert per["gpu-lease"] == {"token": 2000.0, "step": 20000.0, "job": 40000.0, "request": None}
    assert per["MainThread"]["token"] == 500.0


def test_profiler_windows_hold_jobs_counters_and_the_sampled_thread(tmp_path: Path) -> None:
    """Two cuts: the second window has only its own jobs and counter deltas; the file is rewritten at each."""
    path = tmp_path / "profile.json"
    profiler = Profiler(path, interval_s=0.001)
    counters = {"decode_steps": 10, "decoded_tokens": 100, "submitted_rows": 1}
    profiler.counters = lambda: dict(counters)
    stop = threading.Event()

    def busy_worker() -> None:
        while not stop.is_set():
            sum(range(200))

    worker = threading.Thread(target=busy_worker, name="busy-worker", daemon=True)
    worker.start()
    profiler.start()
    try:
        profiler.job_log.append(("DecodeStepActor._link", time.perf_counter(), time.perf_counter() + 0.001))
        _wait(lambda: not profiler.job_log)  # drained into window 0 by the thread
        profiler.mark()  # window 0 ends, on the profiler thread
        _wait(lambda: len(profiler.windows) == 1)
        counters.update(decode_steps=30, decoded_tokens=600, submitted_rows=4)
        profiler.job_log.extend([("PrefillActor._chunk", time.perf_counter(), time.perf_counter() + 0.002)] * 3)
        _wait(lambda: "busy-worker" in profiler._window.stacks)
    finally:
        profiler.stop()
        stop.set()
    doc = json.loads(path.read_text())
    first, second = doc["windows"][:2]
    assert list(first["jobs"]) == ["DecodeStepActor._link"] and first["counts"]["lease_jobs"] == 1
    assert second["jobs"]["PrefillActor._chunk"]["count"] == 3 and "DecodeStepActor._link" not in second["jobs"]
    assert (second["counts"]["steps"], second["counts"]["tokens"], second["counts"]["requests"]) == (20, 500, 3)
    assert second["counts"]["lease_jobs"] == 3
    assert second["samples"]["busy-worker"]["samples"] >= 1
    assert any("busy_worker" in name for name, _ in second["samples"]["busy-worker"]["cumulative"])


def _wait(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the profiler thread never got there"
        time.sleep(0.001)


def test_without_the_variable_nothing_runs_and_a_lease_logs_nothing() -> None:
    with profiling.from_environment({}) as profiler:
        assert profiler is None
        assert GpuLease().job_log is None


def test_with_the_variable_a_new_lease_logs_into_the_profile_and_the_file_is_written(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    with profiling.from_environment({profiling.PROFILE_ENV: str(path)}) as profiler:
        assert profiler is not None
        assert GpuLease().job_log is profiler.job_log
        profiling.watch_counters(lambda: {"decoded_tokens": 5})
    assert GpuLease().job_log is None
    assert len(json.loads(path.read_text())["windows"]) == 1


@pytest.mark.skipif(profiling.MARK_SIGNAL is None, reason="no SIGUSR1 on this platform")
def test_the_mark_signal_cuts_a_window_while_the_server_runs(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    with profiling.from_environment({profiling.PROFILE_ENV: str(path)}) as profiler:
        assert profiler is not None
        os.kill(os.getpid(), profiling.MARK_SIGNAL)
        _wait(lambda: path.exists())  # written at the mark, before the stop
        assert len(json.loads(path.read_text())["windows"]) == 1
    assert [w["index"] for w in json.loads(path.read_text())["windows"]] == [0, 1]


def _square(x: int) -> int:
    return x * x


async def test_the_job_log_names_a_timed_job_after_what_it_wraps() -> None:
    """`chunk_sizer.timed(fn, ...)` logs as "timed(fn)", so a profile tells a solo chunk from a cohort's."""
    from mlx_trio.actors.chunk_sizer import timed
    from mlx_trio.actors.gpu_lease import open_gpu_lease

    async with open_gpu_lease() as lease:
        lease.job_log = log = []
        assert await lease.run(_square, 3) == 9
        result, seconds = await lease.run(timed, _square, 4)
        assert result == 16 and seconds >= 0
    assert [name for name, _, _ in log] == ["_square", "timed(_square)"]
    assert all(start <= end for _, start, end in log)


def test_a_request_timeline_keeps_each_phases_first_time_and_sums_up_the_steps_between_them() -> None:
    from mlx_trio.profiling.requests import RequestTimeline, summary

    timeline = RequestTimeline()
    for i in range(4):
        base = 10.0 * i
        for phase, at in (("arrived", 0.0), ("prepared", 0.001), ("prefill", 0.003), ("token0", 0.010 * (i + 1)),
                          ("first_text", 0.010 * (i + 1) + 0.002)):
            timeline.note(f"r{i}", phase, base + at)
        timeline.note(f"r{i}", "prefill", base + 5.0)  # a later repeat (a resumed prefill) is ignored
    timeline.note("r9", "arrived", 1.0)  # a request that got no further
    taken = timeline.take()
    assert timeline.take() == {} and len(taken) == 5
    got = summary(taken)
    assert got["requests"] == 5
    assert got["arrived->prepared"]["count"] == 4 and got["arrived->prepared"]["p50_ms"] == pytest.approx(1.0)
    assert got["prefill->token0"]["p50_ms"] == pytest.approx(22.0) and got["prefill->token0"]["max_ms"] == pytest.approx(37.0)
    assert got["arrived->first_text"]["p95_ms"] == pytest.approx(42.0)
    assert "token0->first_text" in got and got["token0->first_text"]["max_ms"] == pytest.approx(2.0)


def test_a_served_request_reaches_every_phase_in_the_profile(tmp_path: Path) -> None:
    """Under a profile, the real serve path notes arrived, prepared, prefill, token0 and first_text for a request."""
    import httpx
    from tests.http.http_helpers import ServerThread, tiny_engine_config

    from mlx_trio.http import ServerConfig

    path = tmp_path / "p.json"
    with profiling.from_environment({profiling.PROFILE_ENV: str(path)}):
        with ServerThread(tiny_engine_config(), ServerConfig(port=0)) as server:
            body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
                    "stream": True, "logit_bias": {"0": -100}}
            with httpx.Client(timeout=60) as client, client.stream("POST", server.url + "/v1/chat/completions",
                                                                   json=body) as response:
                assert response.status_code == 200
                lines = list(response.iter_lines())
            assert any('"content":"' in line and '"content":""' not in line for line in lines)
    requests = json.loads(path.read_text())["windows"][-1]["requests"]
    steps = ["arrived->prepared", "prepared->prefill", "prefill->token0", "token0->first_text", "arrived->first_text"]
    assert requests["requests"] == 1 and all(requests[step]["count"] == 1 for step in steps)
