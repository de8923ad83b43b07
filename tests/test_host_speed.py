"""The host-speed probe run beside a benchmark: its samples, its summary, and a stop by SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from diffusers_residency.bench import host_speed


def test_the_summary_counts_the_samples_slower_than_the_fastest_by_the_given_factor() -> None:
    line = host_speed.summary([20.0, 21.0, 40.0, 35.0, 19.0], slow=1.5)
    assert line == (
        "host loop over 5 samples: fastest 19.00 ms, median 21.00 ms, slowest 40.00 ms; "
        "40% took more than 1.5x the fastest"
    )


def test_the_probe_prints_a_timed_sample_per_interval_then_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.time()
    host_speed.main(["--seconds", "0.2", "--interval", "0.05", "--iterations", "1000"])
    *samples, last = capsys.readouterr().out.splitlines()
    assert len(samples) >= 2
    for line in samples:
        stamp, milliseconds = map(float, line.split())
        assert started - 1 <= stamp <= time.time() + 1 and milliseconds > 0
    assert last.startswith(f"host loop over {len(samples)} samples: fastest ")


def test_the_probe_refuses_arguments_that_sample_nothing() -> None:
    with pytest.raises(SystemExit):
        host_speed.main(["--seconds", "0"])
    with pytest.raises(SystemExit):
        host_speed.main(["--slow", "1"])


@pytest.mark.slow
def test_stopped_by_sigterm_beside_a_run_the_probe_sums_up_what_it_sampled() -> None:
    probe = subprocess.Popen(
        [sys.executable, "-m", "diffusers_residency.bench.host_speed", "--seconds", "600", "--interval", "0.05"],
        stdout=subprocess.PIPE,
        text=True,
    )
    first = probe.stdout.readline()  # sampling: the handler is in place
    assert len(first.split()) == 2
    probe.send_signal(signal.SIGTERM)
    rest, _ = probe.communicate(timeout=60)
    assert probe.returncode == 0
    assert rest.splitlines()[-1].startswith("host loop over ")


def test_the_median_of_a_window_takes_the_samples_inside_it_alone() -> None:
    samples = [(1.0, 30.0), (2.0, 10.0), (3.0, 12.0), (4.0, 11.0), (5.0, 40.0)]
    assert host_speed.median_between(samples, 2.0, 4.0) == 11.0
    assert host_speed.median_between(samples, 5.5, 9.0) is None


@pytest.mark.slow
def test_the_parent_samples_until_its_child_exits_and_returns_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_speed, "SAMPLE_SECONDS", 0.01)
    samples: list[tuple[float, float]] = []
    child = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"])
    assert host_speed.sample_while_running(child, samples) == 3
    assert len(samples) >= 3 and all(milliseconds > 0 for _, milliseconds in samples)
    assert [taken for taken, _ in samples] == sorted(taken for taken, _ in samples)


@pytest.mark.slow
def test_the_parent_interrupted_while_sampling_kills_its_child_first(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(iterations: int = host_speed.DEFAULT_ITERATIONS) -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(host_speed, "loop_milliseconds", interrupted)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with pytest.raises(KeyboardInterrupt):
        host_speed.sample_while_running(child, [])
    assert child.returncode is not None, "no child left running"
