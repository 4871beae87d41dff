"""A replica's elastic agent: torchrun's own agent, whose workers are forked from an interpreter
that has already imported the trainer.

`python -m huorn.runtime.agent` takes torchrun's command line unchanged, ending with the trainer
(`-m huorn.runtime.train --config FILE`). What differs is how a worker starts. torchrun starts each
worker as a fresh `python -m huorn.runtime.train`, which imports torch, Huorn and torch._dynamo
(torch.optim imports it at the optimizer's first use): 6-7 s of CPU on a 2-core host before the
worker's first step, paid again at every membership change, since torchrun restarts every worker
of the gang then. This agent imports all of that once, and each (re)start forks a worker from it,
through torch's elastic launcher with a function entrypoint and the `fork` start method.

Forking is safe because the agent never computes: it has no OpenMP pool, no process group and no
CUDA context when it forks. A forked probe checks the last (torch refuses CUDA in a child once the
parent asked the CUDA runtime anything); where it fails, workers start as torchrun starts them. A
worker inherits the agent's stdout and dies with it (torch sets the parent-death signal), and its
exit code reaches the agent as before, so RESTART_EXIT still asks for a re-rendezvous. One
difference is handled here: a worker that returns normally waits until its agent collects the
result, which an agent stopping its workers never does, so a worker stopped by SIGTERM exits at
once, with 143 as a shell would report.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid

TRAINER = "huorn.runtime.train"

log = logging.getLogger(__name__)


def _warm() -> None:
    """Import what every worker needs, so that a forked worker starts with it."""
    import torch._dynamo  # noqa: F401  torch.optim imports it at the optimizer's first use

    from huorn.runtime import train  # noqa: F401


def _fork_is_clean() -> bool:
    """Whether a child forked now could use CUDA. torch poisons fork once this process has asked
    the CUDA runtime anything (torch's own LaunchConfig asks whether CUDA is available; through
    NVML, which main() selects, it does not). A forked probe asks torch itself, in ~10 ms."""
    import torch

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _count_leaves_as_membership_changes() -> None:
    """Make the agents that elastic_launch builds refund the restart a peer's leave costs, and
    give workers the whole shutdown timeout (`--shutdown-timeout`, else
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s) whichever way they are stopped.

    A replica that leaves gracefully (its pod deleted to shrink the gang) checkpoints with the
    others, which then exit RESTART_EXIT to re-rendezvous without it. To torch's agent that exit is
    a worker failure, and each one spends one of `--max-restarts`: a long job resized a hundred
    times had its pods fail on the next leave, and a job at its restart budget failed on a
    routine shrink. A join, the same change the other way round, costs none (torch: "membership
    changes do not count as retries"); a leave now costs none either. Any other exit code, or a
    mix, still counts."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api as launcher_api

    from huorn.runtime import train

    class MembershipAwareAgent(LocalElasticAgent):
        def _stop_workers(self, worker_group: WorkerGroup) -> None:
            # torch's own calls _shutdown() with its default of 30 s, whatever --shutdown-timeout
            # says: a join (restart mode) SIGKILLed workers whose stop step and checkpoint took
            # longer, and the gang resumed from an older checkpoint. The stop a signal starts
            # already honours it; every stop now does.
            self._shutdown(timeout=self._shutdown_timeout)

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result = super()._monitor_workers(worker_group)
            failures = result.failures.values() if result.state == WorkerState.FAILED else ()
            if failures and all(f.exitcode == train.RESTART_EXIT for f in failures):
                # _invoke_run takes one back for the restart. The budget grows with it, so the
                # workers' TORCHELASTIC_RESTART_COUNT (budget less what remains) still counts it.
                self._remaining_restarts += 1
                worker_group.spec.max_restarts += 1
            return result

    launcher_api.LocalElasticAgent = MembershipAwareAgent  # type: ignore[misc]


def run_trainer(*argv: str) -> None:
    """One worker: the trainer's main on its command line. Exit codes other than 0 leave through
    SystemExit, which torch's worker wrapper lets through as the process's exit code."""
    from huorn.runtime import train

    code = train.main(list(argv))
    # Done: a SIGTERM from now on (an agent stopping its workers while this one waits for the
    # result to be collected, say after a peer failed) ends the process at once, as it would have
    # ended a process that had exited; the trainer's handler would only note it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if train.terminated():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or train.LEFT_EXIT)  # 143, as a shell reports a process SIGTERM ended
    if code:
        raise SystemExit(code)


def _refusal(script_args: list[str]) -> str | None:
    """What the trainer would refuse in its config, checked once here: a worker's refusal (exit 2)
    is a failure to torch's agent, which would restart the gang on it up to --max-restarts times."""
    from huorn.runtime import config as run_config
    from huorn.runtime.data import sampler

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", type=str)
    known, _ = parser.parse_known_args(script_args)
    if known.config is None:
        return "the trainer needs --config FILE"
    try:
        cfg = run_config.load_run_config(known.config)
        sampler.check_sources([(s.name, s.path) for s in cfg.spec.data.sources])
    except ValueError as error:
        return str(error)
    return None


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(argv)
    if not args.module or args.training_script != TRAINER:
        raise SystemExit(f"error: huorn.runtime.agent runs the Huorn trainer: end its command line with "
                         f"`-m {TRAINER} --config FILE`, got {args.training_script!r}; for any other "
                         f"script use torchrun (python -m torch.distributed.run)")
    # torch's LaunchConfig asks whether CUDA is available; through NVML the answer does not poison
    # fork (workers inherit the setting, which only changes how torch.cuda.is_available() asks)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    _warm()
    _count_leaves_as_membership_changes()
    refused = _refusal(list(args.training_script_args))
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr, flush=True)
        raise SystemExit(2)  # the trainer's own exit code for a refused config
    forked = argparse.Namespace(**vars(args))
    if forked.standalone:  # as torchrun.run does
        forked.rdzv_backend, forked.rdzv_endpoint, forked.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    forked.start_method = "fork"
    config, _, _ = torchrun.config_from_args(forked)
    if not _fork_is_clean():
        log.warning("CUDA was used in the agent, so a forked worker could not use it: starting "
                    "workers as torchrun does, each a fresh interpreter")
        record(torchrun.run)(args)
        return
    # what `python -u` gives torchrun's workers: their lines reach the log as they are written
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    record(elastic_launch(config=config, entrypoint=run_trainer))(*args.training_script_args)


if __name__ == "__main__":
    main(sys.argv[1:])
