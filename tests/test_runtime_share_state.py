"""Trainer.share_state when the member handing its state over dies part-way: a receiver holds a
mix of two steps in its live tensors, and must not offer that mix to the next round as state."""

from __future__ import annotations

import json
from pathlib import Path

import runtime_harness as harness

# One rank of a world of two (gloo, no torchrun): rank 0 holds step 5 and dies after broadcasting
# three tensors; rank 1 holds step 3 (a member that did not apply the last step) and receives.
_MEMBER = """
import json, os, sys
from huorn.runtime import comm, config, train

from pathlib import Path
cfg = config.load_run_config(Path(sys.argv[1]))
trainer = train.Trainer(cfg)
trainer.has_state = True
held = 5 if trainer.rank == 0 else 3
if trainer.rank == 0:
    sent = []
    broadcast = comm.broadcast_tensor
    def dying(tensor, src, device):
        if len(sent) == 3:
            os._exit(0)
        sent.append(1)
        broadcast(tensor, src, device)
    comm.broadcast_tensor = dying
try:
    trainer.share_state(held)
    outcome = "returned"
except Exception as error:
    outcome = type(error).__name__
print(json.dumps({"outcome": outcome, "has_state": trainer.has_state}), flush=True)
os._exit(0)
"""


def test_a_receiver_cut_off_mid_broadcast_gives_up_its_claim_to_state(tmp_path: Path) -> None:
    config = harness.write_config(tmp_path, harness.shared_data_dir(), collectiveTimeoutS=30)
    outputs = harness.run_members(_MEMBER, config)
    assert outputs[0][0] == "", outputs[0][1][-2000:]  # the source died inside the broadcast
    lines = outputs[1][0].strip().splitlines()
    assert lines, outputs[1][1][-2000:]
    receiver = json.loads(lines[-1])
    assert receiver["outcome"] != "returned"  # gloo reports the lost source
    assert receiver["has_state"] is False
