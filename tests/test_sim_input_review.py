"""`huorn simulate`'s inputs and report after the review of 2026-12-07: times not in seconds, an
arrival window too short to measure goodput over, rows checked only when sampling kept them, empty
deletion times, GPU counts that are no whole replica or no whole GPU, values with spaces, the load
really simulated, the JCT CDF of one job, and the sampling said out loud."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from huorn.cli.main import app
from huorn.sim import engine, inference, policies, report, shared_data, workload

DATA = shared_data.shared_data_dir()
NODES = DATA / "openb_node_list_gpu_node.csv"
QPS = DATA / "genai_qps.csv"
pytestmark = pytest.mark.skipif(not (NODES.exists() and QPS.exists()), reason="no shared node list or QPS")
HEADER = "name,num_gpu,gpu_milli,qos,creation_time,deletion_time\n"
DAY = 86400


def write_pods(path: Path, rows: list[str], header: str = HEADER) -> Path:
    path.write_text(header + "".join(r + "\n" for r in rows))
    return path


def spread_pods(n: int, step: int = 600, length: int = 3600, gpus: int = 1) -> list[str]:
    """n BE pods of `gpus` GPUs, one every `step` seconds, each `length` long."""
    return [f"p{i},{gpus},1000,BE,{step * i},{step * i + length}" for i in range(n)]


def simulate(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["simulate", "--policy", "fifo", *args])
    return result.exit_code, result.stdout, result.stderr


def simulation(pods: Path, policy: str, gpus: int = 32, load: float = 0.8) -> engine.Simulation:
    """A small simulation of every pod of `pods` (sampled as at 1,024 GPUs, so none is dropped)
    on `gpus` GPUs of the shared node list: small hand-made traces, quick runs."""
    config = engine.SimConfig(gpus=gpus, seed=0, load=load)
    nodes = workload.load_nodes(NODES, gpus, config.seed)
    split = engine.split_cluster(nodes, config)
    jobs = workload.load_jobs(pods, workload.FULL_TRACE_GPUS, split.train_gpus, load, config.seed)
    spec = policies.POLICIES[policy]
    qps = inference.InferenceLoad(QPS, split.infer_gpus, config.seed, config.qps_start, board=spec.board)
    return engine.Simulation(jobs, nodes, qps, spec, config)


# ---------------------------------------------------------------- 1. times not in seconds

def test_times_in_milliseconds_or_nanoseconds_are_refused_as_not_seconds(tmp_path: Path) -> None:
    """At times ×1e9 the run hung on 60-second ticks; at ×1000 FIFO's mean JCT came out 1,000×
    too long. A pod longer than a year, or arrivals over more than five years, is refused."""
    long_pod = write_pods(tmp_path / "ms.csv", ["a,1,1000,BE,0,3600", f"b,1,1000,BE,1000,{20 * DAY * 1000}"])
    with pytest.raises(workload.TraceError) as caught:
        workload.load_jobs(long_pod, 1024, 96, 0.8, seed=0)
    message = str(caught.value)
    assert message.startswith(f"{long_pod}:3: column 'deletion_time' ")
    assert "times must be in seconds" in message and "longer than a year" in message
    # short pods, but arrivals a 40-day trace's in milliseconds: 110 years apart
    spread = write_pods(tmp_path / "span.csv", [f"p{i},1,1000,BE,{i * 40 * DAY * 10},{i * 40 * DAY * 10 + 60}"
                                                for i in range(101)])
    with pytest.raises(workload.TraceError, match=r"span.csv:102: column 'creation_time' .* line 2's, "
                                                  r"110 years if in seconds; times must be in seconds"):
        workload.load_jobs(spread, 1024, 96, 0.8, seed=0)
    code, _, err = simulate("--trace", str(long_pod), "--gpus", "64", "--output", str(tmp_path / "o"))
    assert code == 2 and err.startswith(f"error: {long_pod}:3: column 'deletion_time'"), err
    # the bounds leave room: a pod of 360 days over a trace of four years passes
    fine = write_pods(tmp_path / "fine.csv", ["a,1,1000,BE,0,3600", f"b,1,1000,BE,{4 * 365 * DAY},"
                                              f"{4 * 365 * DAY + 360 * DAY}"])
    assert len(workload.load_jobs(fine, 1024, 96, 0.8, seed=0)) == 2


# ---------------------------------------------------------------- 2. goodput over a short window

def test_an_arrival_window_shorter_than_three_ticks_gives_null_goodput_and_no_ratio(tmp_path: Path) -> None:
    """Every arrival within seconds: the goodput over the window was an interpolation between
    tick samples (FIFO 0.33, Huorn 11.3, 'goodput_vs_fifo' 33.8). It is null with its reason now;
    the ratios that do not read it stay."""
    pods = write_pods(tmp_path / "burst.csv", [f"p{i},1,1000,BE,{i},{i + 1800}" for i in range(12)])
    sims = {name: simulation(pods, name) for name in ("fifo", "huorn")}
    results = {}
    for name, sim in sims.items():
        sim.run()
        results[name] = report.summarise(sim, 0.0)
    for metrics in results.values():
        assert metrics["goodput_gpu_equiv"] is None
        assert "shorter than 3 ticks (180 s)" in metrics["goodput_gpu_equiv_null_reason"]
        assert metrics["goodput_saturated_gpu_equiv"] > 0
    compared = report.compare(results)
    assert "goodput_vs_fifo" not in compared
    assert compared["job_goodput_vs_fifo"] > 0 and compared["saturated_goodput_vs_fifo"] > 0
    out = tmp_path / "report"
    report.write_report(out, results, sims)
    assert json.loads((out / "report.json").read_text())["policies"]["fifo"]["goodput_gpu_equiv"] is None
    assert (out / "metrics.png").stat().st_size > 1000

    # and the table on stdout says n/a, with the reason on stderr
    code, out_text, err = simulate("--trace", str(pods), "--gpus", "1024", "--output", str(tmp_path / "o"))
    assert code == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out_text.splitlines()}
    assert rows["goodput_gpu_equiv"] == ["n/a"]
    assert "note: fifo: goodput_gpu_equiv is null (n/a): the arrival window" in err

    # a window of many ticks is measured as ever (here some 2.5 hours)
    sim = simulation(write_pods(tmp_path / "spread.csv", spread_pods(30, gpus=2)), "fifo")
    sim.run()
    metrics = report.summarise(sim, 0.0)
    window = max(js.job.arrival for js in sim.jobs)
    assert window > 100 * sim.config.tick_seconds
    assert metrics["goodput_gpu_equiv"] == pytest.approx(report._work_done_by(sim, window) / window)
    assert "goodput_gpu_equiv_null_reason" not in metrics


# ---------------------------------------------------------------- 3. every row checked before sampling

def test_every_training_row_is_checked_whether_or_not_sampling_keeps_it(tmp_path: Path) -> None:
    """A bad creation time passed at --gpus 64 (its row not drawn) and failed at 1,024."""
    rows = spread_pods(40)
    draws = np.random.default_rng(0).random(len(rows))
    dropped = int(np.flatnonzero(draws >= 64 / workload.FULL_TRACE_GPUS)[0])
    rows[dropped] = f"p{dropped},1,1000,BE,yesterday,100"
    pods = write_pods(tmp_path / "p.csv", rows)
    with pytest.raises(workload.TraceError) as caught:
        workload.load_jobs(pods, 64, 48, 0.8, seed=0)
    assert str(caught.value) == f"{pods}:{dropped + 2}: column 'creation_time' must be a finite number, " \
                                "got 'yesterday'"


def test_the_checks_keep_one_draw_per_training_row(tmp_path: Path) -> None:
    """The same seed keeps the same pods as before the checks moved ahead of the draw."""
    rows = ["svc,1,1000,LS,5,50", "cpu,0,0,BE,6,60", *spread_pods(300)]  # neither training: no draw
    pods = write_pods(tmp_path / "p.csv", rows)
    sample = workload.sample_training_pods(pods, 64, seed=3)
    draws = np.random.default_rng(3).random(300)
    assert [name for _, _, _, name in sample.pods] == [f"p{i}" for i in np.flatnonzero(draws < 64 / 1024)]
    assert sample.training == 300 and sample.keep == 64 / 1024


# ---------------------------------------------------------------- 4. an empty deletion time

def test_an_empty_deletion_time_is_refused_naming_line_and_column(tmp_path: Path) -> None:
    """It made a silent 1-second job."""
    pods = write_pods(tmp_path / "p.csv", ["a,1,1000,BE,0,100", "b,1,1000,BE,10,"])
    with pytest.raises(workload.TraceError) as caught:
        workload.load_jobs(pods, 1024, 96, 0.8, seed=0)
    assert str(caught.value).startswith(f"{pods}:3: column 'deletion_time' is empty; ")
    code, _, err = simulate("--trace", str(pods), "--gpus", "64", "--output", str(tmp_path / "o"))
    assert code == 2 and err.startswith(f"error: {pods}:3: column 'deletion_time' is empty"), err


# ---------------------------------------------------------------- 5. and 6. GPU counts

def test_eight_or_more_gpus_must_be_whole_8_gpu_replicas(tmp_path: Path) -> None:
    """12 GPUs ran as one 8-GPU replica while 12 drove the reference goodput and the bounds."""
    pods = write_pods(tmp_path / "p.csv", ["a,1,1000,BE,0,100", "b,12,1000,BE,10,1000"])
    with pytest.raises(workload.TraceError) as caught:
        workload.load_jobs(pods, 1024, 96, 0.8, seed=0)
    assert str(caught.value).startswith(f"{pods}:3: column 'num_gpu' is 12: a pod of 8 GPUs or more runs as "
                                        "8-GPU replicas")
    assert "give a multiple of 8" in str(caught.value)
    pods = write_pods(tmp_path / "p.csv", ["a,1,1000,BE,0,100", "b,16,1000,BE,10,1000"])
    llm = workload.load_jobs(pods, 1024, 96, 0.8, seed=0)[1]
    assert (llm.requested_gpus, llm.requested_replicas, llm.family.name) == (16, 2, "llm")


@pytest.mark.parametrize("gpus", ["0.5", "1.5"])
def test_a_fraction_of_a_gpu_is_refused_pointing_at_gpu_milli(tmp_path: Path, gpus: str) -> None:
    """int(float()) made 0.5 a pod with no GPU (silently dropped) and 1.5 a 1-GPU pod."""
    pods = write_pods(tmp_path / "p.csv", ["a,1,1000,BE,0,100", f"b,{gpus},1000,BE,10,1000"])
    with pytest.raises(workload.TraceError) as caught:
        workload.load_jobs(pods, 1024, 96, 0.8, seed=0)
    assert str(caught.value) == (f"{pods}:3: column 'num_gpu' must be a whole number of GPUs, got {gpus!r}; "
                                 "a fraction of a GPU goes in gpu_milli with num_gpu=1 (e.g. 500 for half)")


# ---------------------------------------------------------------- 7. the load really simulated

def test_the_report_records_the_load_simulated_and_the_compression(tmp_path: Path) -> None:
    """config.load said 0.8 while a small trace could offer 0.18 and ran at that."""
    pods = write_pods(tmp_path / "p.csv", spread_pods(12, step=3600, length=600))
    out = tmp_path / "o"
    code, _, err = simulate("--trace", str(pods), "--gpus", "1024", "--output", str(out))
    assert code == 0, err
    config = json.loads((out / "report.json").read_text())["config"]
    train_gpus = engine.split_cluster(workload.load_nodes(NODES, 1024, 0), engine.SimConfig(1024)).train_gpus
    most = workload.most_offered_load(pods, 1024, train_gpus, 0)
    assert config["load"] == 0.8 and f"offers a training load of at most {int(most * 100) / 100:.2f}" in err
    assert config["offered_load_simulated"] == pytest.approx(most)
    assert config["arrival_compression"] == workload.MAX_COMPRESSION
    assert (config["training_pods_in_trace"], config["training_pods_kept"]) == (12, 12)


# ---------------------------------------------------------------- 8. and 9. how the CSV is written

def test_values_with_spaces_after_commas_are_read_as_without(tmp_path: Path) -> None:
    """", " separators read qos " BE": no training pods."""
    rows = spread_pods(5)
    plain = workload.load_jobs(write_pods(tmp_path / "a.csv", rows), 1024, 96, 0.8, seed=0)
    spaced = workload.load_jobs(write_pods(tmp_path / "b.csv", [r.replace(",", ", ") for r in rows],
                                           HEADER.replace(",", ", ")), 1024, 96, 0.8, seed=0)
    assert [(j.name, j.arrival, j.duration, j.requested_gpus) for j in spaced] == [
        (j.name, j.arrival, j.duration, j.requested_gpus) for j in plain]


def test_no_training_pods_shows_the_qos_values_seen(tmp_path: Path) -> None:
    pods = write_pods(tmp_path / "p.csv", ["a,1,1000,be,0,100", "b,1,1000,be,0,100", "c,1,1000,LS,0,9"])
    with pytest.raises(workload.TraceError) as caught:
        workload.load_jobs(pods, 1024, 96, 0.8, seed=0)
    assert str(caught.value).startswith(f"{pods}: no training pods")
    assert str(caught.value).endswith("column 'qos' holds 'be' (2), 'LS' (1)")


def test_gpu_milli_is_not_required(tmp_path: Path) -> None:
    """It was required and never read."""
    pods = write_pods(tmp_path / "p.csv", ["a,1,BE,0,100", "b,2,Burstable,10,50"],
                      header="name,num_gpu,qos,creation_time,deletion_time\n")
    assert [j.requested_gpus for j in workload.load_jobs(pods, 1024, 96, 0.8, seed=0)] == [1, 2]
    assert "gpu_milli" not in workload.POD_COLUMNS


# ---------------------------------------------------------------- 10. the JCT CDF

def test_the_jct_cdf_rises_to_one_in_steps_and_shows_a_single_job(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """linspace(0, 1, n) put the first job at 0 (off by one) and drew nothing for a single job."""
    from matplotlib.axes import Axes

    drawn: list[tuple[np.ndarray, dict]] = []
    plot = Axes.plot

    def recording(self: Axes, *args: object, **kwargs: object) -> object:
        if kwargs.get("label") == "fifo":
            drawn.append((np.asarray(args[1]), kwargs))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording)
    sim = simulation(write_pods(tmp_path / "one.csv", ["solo,1,1000,BE,0,600"]), "fifo")
    sim.run()
    report.write_report(tmp_path / "o", {"fifo": report.summarise(sim, 0.0)}, {"fifo": sim})
    [(shares, kwargs)] = drawn
    assert shares.tolist() == [1.0]
    assert kwargs["drawstyle"] == "steps-post" and kwargs.get("marker")


# ---------------------------------------------------------------- 11. the sampling said

def test_the_sampling_says_how_many_training_pods_it_kept(tmp_path: Path) -> None:
    """The N/1024 rule applied to any trace without a word."""
    pods = write_pods(tmp_path / "p.csv", spread_pods(300))
    kept = int(np.sum(np.random.default_rng(0).random(300) < 64 / 1024))
    code, _, err = simulate("--trace", str(pods), "--gpus", "64", "--output", str(tmp_path / "o"))
    assert code == 0, err
    assert f"note: kept {kept} of 300 training pods (probability 64/1024 = 0.0625 each at --gpus 64; " \
           "all at --gpus 1024)\n" in err
