"""In place on NCCL: a SIGKILLed peer is found by the heartbeats (huorn.runtime.peer_watch), the
survivor aborts its groups and regroups in its own process, with no checkpoint restart. Needs two
CUDA GPUs (the device tool's nvidia-h200-x2); CI has none, and tests/test_runtime_peer_watch.py
covers the heartbeats on CPU."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import runtime_harness as harness
import torch

from huorn.runtime import launcher, steplog

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def test_a_killed_nccl_peer_is_left_behind_in_place(tmp_path: Path) -> None:
    steps = 400
    spec = harness.build_spec(steps=steps, interval_steps=50, min_replicas=1, max_replicas=2)
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec, device="cuda",
                                  peer_timeout_s=5.0, faults=[{"kind": "slow-compute", "ms": 50}])
    store, port = harness.start_store(tmp_path)
    run_dir = tmp_path / "run"
    replicas: dict[int, subprocess.Popen] = {}
    try:
        for replica in (0, 1):
            settings = launcher.ElasticSettings(min_nodes=1, max_nodes=2, rdzv_endpoint=f"127.0.0.1:{port}",
                                                rdzv_id="gpu", local_addr=launcher.replica_address(replica))
            replicas[replica] = launcher.start_agent(
                config, settings, f"r{replica}", tmp_path / f"r{replica}.log",
                env=harness.child_env(CUDA_VISIBLE_DEVICES=str(replica)), in_place=True)
        harness.wait_for(lambda: steplog.last_step(run_dir) >= 10 and any(
            e["event"] == "step" and e["world_size"] == 2 for e in steplog.read_events(run_dir)), 300,
            "steps at world size 2")
        killed_at = time.time()
        assert launcher.kill_process_tree(replicas[1].pid)
        recovered = harness.wait_for(lambda: steplog.first_step_after(run_dir, killed_at, 1), 120,
                                     "a step at world size 1")
        assert replicas[0].wait(timeout=600) == 0, (tmp_path / "r0.log").read_text()[-3000:]
    finally:
        for process in replicas.values():
            launcher.kill_process_tree(process.pid)
        launcher.kill_process_tree(store.pid)
    events = steplog.read_events(run_dir)
    assert [e["event"] for e in events].count("start") == 1  # nobody restarted from a checkpoint
    regroups = [e for e in events if e["event"] == "regroup"]
    # The abort ends the survivor's wait either in a collective (NCCL: "communicator was aborted")
    # or at the check before the step is applied, whichever it reaches first.
    assert [(r["reason"], r["world_size"]) for r in regroups] in (
        [("peer-lost: DistBackendError", 1)], [("peer-lost: PeerLostError", 1)])
    assert sorted(steplog.effective_steps(events)) == list(range(1, steps + 1))
    # Found within the peer timeout and a heartbeat or two, not the 120 s collective timeout.
    assert recovered - killed_at < 30, recovered - killed_at
    print(f"\nSIGKILL to a step at world size 1: {recovered - killed_at:.1f} s")
