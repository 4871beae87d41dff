"""The RL runtime: the objectives against their formulas, sampling against teacher forcing, the
verifiable rewards, one real update's direction, and (slow) the single controller over a real
local Ray cluster, resumed from its checkpoint."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import runtime_harness as harness
import torch
from api_support import admit, build_manifest, crd_errors

from huorn import models
from huorn.api import manifests, rl, training
from huorn.runtime import checkpoint
from huorn.runtime import config as run_config
from huorn.runtime.rl import algorithms, controller, policy, progress, tasks, workers

MODEL = {"layers": 2, "width": 32, "heads": 2, "context": 64}

_HOLD_RAY = """
import sys, ray
started = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
print(started.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[dict[str, str]]:
    """A local Ray cluster of 2 CPUs that the module's controller runs share through RAY_ADDRESS,
    as controllers do on a KubeRay cluster (a start and stop cost about 8 s of CPU here): the
    variables that reach it. Held by a process of its own: controller.main, which other tests
    here call in this process, shuts this process's Ray down. Each controller's actors end with
    it, as a driver's do."""
    # NB: the auth mode stated, for the cluster and its clients alike: left unset, a cluster
    # started where ~/.ray/auth_token exists turns token auth on for itself alone
    reach = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env = harness.child_env(**reach)  # OMP_NUM_THREADS=1: the raylet's workers inherit it
    env.pop("RAY_ADDRESS", None)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_RAY], cwd=harness.REPO, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = holder.stdout.readline().strip()  # type: ignore[union-attr]
        assert address and holder.poll() is None, "the Ray cluster's holder exited"
        yield {**reach, "RAY_ADDRESS": address}
    finally:
        holder.stdin.close()  # type: ignore[union-attr]
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


def _settings(**fields: object) -> algorithms.Settings:
    return algorithms.resolve(rl.AlgorithmSpec.model_validate(fields))


def test_each_algorithm_is_its_papers_preset_and_set_fields_override_it() -> None:
    grpo, dapo, lite = (_settings(name=n) for n in ("grpo", "dapo", "lite-ppo"))
    assert (grpo.std, grpo.aggregation, grpo.kl_coefficient) == (rl.Normalisation.GROUP, "sequence",
                                                                  0.04)
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token")
    assert dapo.dynamic_sampling
    assert dapo.kl_coefficient == 0
    assert (lite.mean, lite.std) == (rl.Normalisation.GROUP, rl.Normalisation.BATCH)
    assert lite.aggregation == "token"
    assert _settings(name="dapo", clipHigh=0.3, dynamicSampling=False).clip_high == 0.3
    assert not _settings(name="dapo", dynamicSampling=False).dynamic_sampling
    with pytest.raises(ValueError, match=r"^spec\.algorithm\.name: ppo needs a critic"):
        _settings(name="ppo")


PRESETS = {
    "grpo": (rl.Normalisation.GROUP, 0.2, 0.2, "sequence", 0.04, False),
    "dapo": (rl.Normalisation.GROUP, 0.2, 0.28, "token", 0.0, True),
    "lite-ppo": (rl.Normalisation.BATCH, 0.2, 0.2, "token", 0.0, False),
}


def _choices(settings: algorithms.Settings) -> tuple[object, ...]:
    return (settings.std, settings.clip_low, settings.clip_high, settings.aggregation,
            settings.kl_coefficient, settings.dynamic_sampling)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_spec_keeps_its_preset_through_the_wire_the_cli_and_the_trainer(name: str, tmp_path: Path) -> None:
    """The spec's wire form (what `huorn run` writes into the controller's config, what the API
    server stores with the CRD's defaults, what the controller hands its trainers) had every
    algorithm field written out at the old defaults, and `resolve` took each as the user's: GRPO
    trained with no KL, DAPO without clip-higher, token loss or dynamic sampling, Lite PPO with
    group std and per-sequence loss."""
    partial = {"virtualCluster": "x", "model": MODEL, "algorithm": {"name": name, "groupSize": 2},
               "optimization": {"promptsPerStep": 1}}
    job = manifests.load_manifest({"apiVersion": "huorn.io/v1alpha1", "kind": "RLJob",
                                   "metadata": {"name": "rl", "namespace": "d"}, "spec": partial})
    wire = job.spec.to_wire()
    assert _choices(algorithms.resolve(rl.RLJobSpec.model_validate(wire).algorithm)) == PRESETS[name]
    stored = admit("RLJob", build_manifest("RLJob", partial))  # the CRD's defaults applied
    from_server = rl.RLJobSpec.model_validate(stored["spec"]).algorithm
    assert _choices(algorithms.resolve(from_server)) == PRESETS[name]
    trainer = workers.PolicyTrainer(wire, None, str(tmp_path / "ckpt"), "cpu")
    assert _choices(trainer.settings) == PRESETS[name]


def test_a_dapo_clip_low_is_judged_against_dapos_clip_high() -> None:
    """clipLow 0.25 under DAPO (clip-higher 0.28) was refused as above the field's old default 0.2."""
    assert _settings(name="dapo", clipLow=0.25).clip_low == 0.25
    for spec in ({"name": "dapo", "clipLow": 0.3}, {"name": "grpo", "clipLow": 0.25},
                 {"name": "lite-ppo", "clipHigh": 0.1}):
        manifest = build_manifest("RLJob", {"algorithm": spec})
        with pytest.raises(manifests.ManifestError, match=r"spec\.algorithm\.clipHigh: must be ≥ clipLow"):
            manifests.load_manifest(manifest)
        assert crd_errors("RLJob", manifest), spec
    for spec in ({"name": "dapo", "clipLow": 0.25}, {"name": "grpo", "clipHigh": 0.3},
                 {"name": "grpo", "clipLow": 0.1, "clipHigh": 0.15}):
        manifest = build_manifest("RLJob", {"algorithm": spec})
        manifests.load_manifest(manifest)
        assert crd_errors("RLJob", manifest) == [], spec


def test_advantages_normalise_by_group_or_batch() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    group = algorithms.advantages(rewards, _settings(name="grpo"))
    centred = rewards - rewards.mean(1, keepdim=True)
    expected = centred / (rewards.std(1, keepdim=True, unbiased=False) + 1e-6)
    assert torch.allclose(group, expected, atol=1e-6)
    batch = algorithms.advantages(rewards, _settings(name="lite-ppo"))
    expected = centred / (rewards.std(unbiased=False) + 1e-6)
    assert torch.allclose(batch, expected, atol=1e-6)
    alike = algorithms.advantages(torch.ones(1, 4), _settings(name="grpo"))
    assert torch.equal(alike, torch.zeros(1, 4))  # nothing to learn from a group that all scored alike
    assert algorithms.informative_groups(rewards).tolist() == [True, True]
    assert algorithms.informative_groups(torch.tensor([[1.0, 1.0], [0.0, 1.0]])).tolist() == [False, True]


def test_the_clipped_surrogate_clips_asymmetrically_and_aggregates_as_asked() -> None:
    dapo = _settings(name="dapo")  # ε_low 0.2, ε_high 0.28
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 1.1, 0.5], [0.7, 1.0, 1.0]]))
    advantage = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    parts = algorithms.policy_loss(new, old, advantage, mask, dapo)
    # Row 0, A = +1: min(ρ, clip(ρ, 0.8, 1.28)) = 1.28, 1.1, 0.5. Row 1, A = −1: −min(−ρ, −clip) =
    # max(ρ, clip(ρ)) = 0.8, 1.0 (the third token is masked out).
    per_token = torch.tensor([[-1.28, -1.1, -0.5], [0.8, 1.0, 0.0]])
    assert parts.policy == pytest.approx(float(per_token.sum() / 5), abs=1e-6)
    assert parts.clip_fraction == pytest.approx(2 / 5)  # 1.5 above 1.28, 0.7 below 0.8
    by_sequence = _settings(name="dapo", lossAggregation="sequence")
    sequence = algorithms.policy_loss(new, old, advantage, mask, by_sequence)
    means = (per_token[0].sum() / 3 + per_token[1].sum() / 2) / 2
    assert sequence.policy == pytest.approx(float(means), abs=1e-6)


def test_the_kl_term_is_k3_to_the_reference() -> None:
    new, reference = torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.4, 0.2]]))
    k3 = algorithms.k3(new, reference)
    assert float(k3[0, 0]) == pytest.approx(0.8 - math.log(0.8) - 1, abs=1e-6) and float(k3[0, 1]) == 0
    grpo = _settings(name="grpo")
    parts = algorithms.policy_loss(new, new.detach(), torch.zeros(1), torch.ones(1, 2), grpo, reference)
    assert parts.kl == pytest.approx(float(k3.mean()), abs=1e-6)
    assert float(parts.loss) == pytest.approx(0.04 * parts.kl, abs=1e-7)
    with pytest.raises(ValueError, match="reference"):
        algorithms.policy_loss(new, new, torch.zeros(1), torch.ones(1, 2), grpo)


def test_overlong_shaping_is_zero_then_a_ramp_then_minus_one() -> None:
    penalty = algorithms.overlong_penalty(torch.tensor([10, 16, 18, 20, 21]), max_length=20, buffer=4)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_dynamic_sampling_drops_groups_by_their_scores_not_by_the_length_penalty() -> None:
    """DAPO drops the groups that are all right or all wrong. An all-wrong group with one answer
    in the overlong buffer differs only by its length penalty: kept, its std-normalised
    advantages trained on length alone."""
    spec = rl.RLJobSpec.model_validate({"virtualCluster": "x", "model": MODEL, "algorithm": {
        "name": "dapo", "groupSize": 4, "overlongMaxLength": 8, "overlongBuffer": 4},
        "optimization": {"promptsPerStep": 2}})
    lengths = {0: [2, 2, 6, 2], 1: [2, 2, 2, 2]}  # prompt 0: one answer 2 tokens into the buffer
    scores = {0: [0.0, 0.0, 0.0, 0.0], 1: [1.0, 0.0, 1.0, 0.0]}

    def generate(prompts: list[tasks.Prompt], seed: int) -> list[dict]:
        return [{"prompt": k, "mask": torch.tensor([[1.0] * n + [0.0] * (8 - n) for n in lengths[k % 2]])}
                for k, _ in enumerate(prompts)]

    run = types.SimpleNamespace(spec=spec, settings=algorithms.resolve(spec.algorithm), generate=generate,
                                score=lambda items: [scores[item["prompt"] % 2] for item in items])
    kept, stats = controller.Controller.rollout_step(run, 1)  # type: ignore[arg-type]
    assert [item["prompt"] % 2 for item in kept] == [1, 1], "every all-wrong group is dropped"
    assert stats["groups_dropped"] == 2 and stats["groups_drawn"] == 4  # two rounds of two
    assert kept[0]["rewards"].tolist() == scores[1] and kept[0]["scores"].tolist() == scores[1]


def test_sampled_log_probabilities_equal_the_teacher_forced_ones() -> None:
    torch.manual_seed(0)
    model = models.build_model(run_config.build_model_config(rl.RLJobSpec.model_validate(
        {"virtualCluster": "x", "model": MODEL}).model))
    prompt = list(b"Q: What is 2 + 3?\nA:")
    samples = policy.sample(model, prompt, 4, 10, 1.0, 1.0, torch.Generator().manual_seed(1))
    forced = policy.response_logprobs(model.eval(), prompt, samples.tokens)
    assert torch.allclose(forced * samples.mask, samples.sampled_logprobs, atol=1e-4)
    assert torch.equal(samples.mask, policy.response_mask(samples.tokens))
    # Below top-p 1 they are still the full distribution's, the one the trainer scores.
    nucleus = policy.sample(model, prompt, 4, 10, 1.0, 0.5, torch.Generator().manual_seed(1))
    forced = policy.response_logprobs(model, prompt, nucleus.tokens)
    assert torch.allclose(forced * nucleus.mask, nucleus.sampled_logprobs, atol=1e-4)
    # A top-p this small keeps only the most likely token: sampling becomes greedy.
    narrow = policy.sample(model, prompt, 2, 6, 1.0, 1e-6, torch.Generator().manual_seed(2))
    greedy = policy.sample(model, prompt, 2, 6, 0.0, 1.0, torch.Generator())
    assert torch.equal(narrow.tokens, greedy.tokens)


def test_the_trainer_and_the_reference_score_the_temperature_that_sampled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At temperature 0.7 the trainer's π_old (and the reference's π_ref) are the log-probabilities
    the tokens were sampled with. They scored the plain logits: 0.39-2.06 times the sampling
    probability on a peaked policy's tokens."""
    spec = {"virtualCluster": "x", "model": MODEL, "algorithm": {"name": "grpo", "groupSize": 8},
            "rollout": {"maxNewTokens": 6, "temperature": 0.7, "topP": 1.0},
            "optimization": {"learningRate": 1e-9, "promptsPerStep": 1}}
    trainer = workers.PolicyTrainer(spec, None, str(tmp_path / "ckpt"), "cpu")
    with torch.no_grad():  # a peakier policy, as a trained one is
        for weight in trainer.model.parameters():
            weight.mul_(3.0)
    reference = workers.ReferenceWorker(spec, None, "cpu")
    reference.model.load_state_dict(trainer.model.state_dict())
    prompt = list(b"Q: What is 2 + 3?\nA:")
    samples = policy.sample(trainer.model, prompt, 8, 6, 0.7, 1.0, torch.Generator().manual_seed(0))
    item = {"prompt": prompt, "tokens": samples.tokens, "mask": samples.mask,
            "advantages": torch.linspace(-1, 1, 8)}
    item["reference"] = reference.logprobs([item])[0]
    seen: dict[str, torch.Tensor] = {}
    loss = algorithms.policy_loss

    def spy(new: torch.Tensor, old: torch.Tensor, *args: Any, **kwargs: Any) -> algorithms.LossParts:
        seen.setdefault("old", old.clone())
        return loss(new, old, *args, **kwargs)

    monkeypatch.setattr(algorithms, "policy_loss", spy)
    metrics = trainer.update([item])
    assert torch.allclose(seen["old"] * samples.mask, samples.sampled_logprobs, atol=1e-4)
    assert torch.allclose(item["reference"] * samples.mask, samples.sampled_logprobs, atol=1e-4)
    assert metrics["kl"] < 1e-6


@pytest.mark.parametrize(("groups", "mini_batches", "steps"), [(4, 3, 3), (5, 2, 2), (2, 3, 2), (7, 7, 7)])
def test_a_pass_takes_mini_batches_optimiser_steps(tmp_path: Path, groups: int, mini_batches: int,
                                                   steps: int) -> None:
    """Chunks of ceil(groups / miniBatches) made fewer steps than asked: 4 groups in 3 gave 2."""
    spec = {"virtualCluster": "x", "model": MODEL, "algorithm": {"name": "lite-ppo", "groupSize": 2},
            "rollout": {"maxNewTokens": 4},
            "optimization": {"promptsPerStep": 8, "miniBatches": mini_batches, "updateEpochs": 2}}
    trainer = workers.PolicyTrainer(spec, None, str(tmp_path / "ckpt"), "cpu")
    rollout = workers.RolloutWorker(spec, "cpu")
    rollout.load(trainer.weights(), 0)
    batch = rollout.generate([(f"Q: What is {i} + 1?\nA:", str(i + 1), i) for i in range(groups)])
    for item in batch:
        item["advantages"] = torch.tensor([1.0, -1.0])
    assert trainer.update(batch)["updates"] == 2 * steps


def test_a_lagged_batchs_pi_old_is_the_policy_that_sampled_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncSteps 1: step t+1's groups are sampled with θ_t and trained after step t's update, at
    θ_{t+1}. Their π_old must be π_{θ_t}, the rollout model's; the trainer recomputed it with
    θ_{t+1}, so the ratio at the first optimiser step was exactly 1 whatever the lag. Through
    the controller's train_step, its trainer in this process."""
    spec = {"virtualCluster": "x", "model": MODEL, "algorithm": {"name": "lite-ppo", "groupSize": 8},
            "rollout": {"maxNewTokens": 6, "asyncSteps": 1, "temperature": 0.8},
            "optimization": {"learningRate": 1e-2, "promptsPerStep": 1, "miniBatches": 1}}
    trainer = workers.PolicyTrainer(spec, None, str(tmp_path / "ckpt"), "cpu")
    rollout = workers.RolloutWorker(spec, "cpu")
    rollout.load(trainer.weights(), 0)
    running = controller.Controller.__new__(controller.Controller)  # no Ray: the trainer in process
    running.settings, running.trainers = trainer.settings, types.SimpleNamespace(update=trainer.update)
    running.references = running.rollouts = types.SimpleNamespace(members=[])
    running.pools = ()
    running.log = lambda record: None  # type: ignore[method-assign]
    seen: list[torch.Tensor] = []
    loss = algorithms.policy_loss

    def spy(new: torch.Tensor, old: torch.Tensor, *args: Any, **kwargs: Any) -> algorithms.LossParts:
        seen.append(old.clone())
        return loss(new, old, *args, **kwargs)

    monkeypatch.setattr(algorithms, "policy_loss", spy)

    def rollout_of(text: str, answer: str, seed: int) -> controller.Rollout:
        items = rollout.generate([(text, answer, seed)])
        for item in items:  # rewards that differ within the group: advantages that move the policy
            item["scores"] = item["rewards"] = torch.tensor([1.0, 0.0] * 4)
        return controller.Rollout(items, {})

    step0 = rollout_of("Q: What is 2 + 3?\nA:", "5", 1)  # both sampled by θ_0, as asyncSteps 1 does
    step1 = rollout_of("Q: What is 7 + 1?\nA:", "8", 2)
    running.train_step(0, step0, 0.0)  # θ_0 → θ_1
    item = step1.items[0]
    mask = item["mask"]
    sampler = policy.response_logprobs(rollout.model.eval(), item["prompt"], item["tokens"], 0.8) * mask
    trained = policy.response_logprobs(trainer.model.eval(), item["prompt"], item["tokens"], 0.8) * mask
    assert not torch.allclose(sampler, trained, atol=1e-2), "the update moved the policy"
    running.train_step(1, step1, 0.0)  # trained at θ_1, sampled by θ_0
    assert torch.allclose(seen[-1] * mask, sampler, atol=1e-5)
    assert torch.allclose(item["logprobs"], sampler, atol=1e-5)


def test_the_response_mask_ends_with_each_rows_first_newline() -> None:
    n, a = policy.NEWLINE, ord("7")
    tokens = torch.tensor([[a, n, a, a], [a, a, a, a], [n, a, n, a], [a, a, a, n]])
    assert policy.response_mask(tokens).tolist() == [
        [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_prompts_are_reproducible_and_rewards_check_the_first_line() -> None:
    assert tasks.prompts("arithmetic-small", 0, 3, 5) == tasks.prompts("arithmetic-small", 0, 3, 5)
    assert tasks.prompts("arithmetic-small", 0, 3, 5) != tasks.prompts("arithmetic-small", 0, 4, 5)
    for p in tasks.prompts("arithmetic-small", 0, 0, 20):
        question = p.text.removeprefix("Q: What is ").removesuffix("?\nA:")
        if question.startswith("the square of "):
            assert int(p.answer) == int(question.removeprefix("the square of ")) ** 2
        else:
            assert int(p.answer) == int(eval(question.replace("/", "//")))
    exact, form = rl.RewardSpec(type="math-exact"), rl.RewardSpec(type="format")
    prompt = tasks.Prompt("Q: What is 2 + 3?\nA:", "5")
    assert tasks.score(exact, prompt, " 5\nQ: What") == 1.0 and tasks.score(exact, prompt, " 6\n") == 0.0
    assert tasks.score(form, prompt, " 6\n") == 1.0 and tasks.score(form, prompt, " six\n") == 0.0
    with pytest.raises(ValueError, match=r"^spec\.reward\.type: code-tests needs a code sandbox"):
        tasks.check_reward(rl.RewardSpec(type="code-tests"))
    with pytest.raises(ValueError, match=r"^spec\.reward\.dataset: 'gsm8k'"):
        tasks.check_reward(rl.RewardSpec(dataset="gsm8k"))


def test_held_out_prompts_are_distinct_and_never_drawn_for_training() -> None:
    """The held-out set is split off by content: no training step of seeds 0 and 1 (any of
    DAPO's three rounds) draws one of its questions, and it repeats none. It was another random
    stream over arithmetic-small's 1,763 questions, half of whose held-out prompts a 60-step run
    trained on."""
    for seed in (0, 1):
        held = tasks.held_out("arithmetic-small", seed, 256)
        texts = {p.text for p in held}
        assert len(texts) == len(held) > 150, "distinct, and as many as the split has"
        assert all(tasks.is_held_out(p.text.removeprefix("Q: ").removesuffix("\nA:")) for p in held)
        trained = {p.text for step in range(200) for round_ in range(3)
                   for p in tasks.prompts("arithmetic-small", seed, step, 16, round_=round_)}
        assert not trained & texts
    assert len(tasks.held_out("arithmetic", 0, 300)) == 300


def test_an_update_raises_the_rewarded_response_and_lowers_the_other(tmp_path: Path) -> None:
    spec = {"virtualCluster": "x", "model": MODEL, "algorithm": {"name": "lite-ppo", "groupSize": 2},
            "optimization": {"learningRate": 3e-3, "promptsPerStep": 1}}
    trainer = workers.PolicyTrainer(spec, None, str(tmp_path / "ckpt"), "cpu")
    prompt = list(b"Q: What is 2 + 3?\nA:")
    tokens = torch.tensor([list(b" 5\n"), list(b" 9\n")])
    mask = torch.ones(2, 3)
    before = policy.response_logprobs(trainer.model.eval(), prompt, tokens).sum(dim=1)
    item = {"prompt": prompt, "tokens": tokens, "mask": mask, "advantages": torch.tensor([1.0, -1.0]),
            "reference": None}
    metrics = trainer.update([item])
    after = policy.response_logprobs(trainer.model.eval(), prompt, tokens).sum(dim=1)
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["updates"] == 1 and metrics["grad_norm"] > 0


def test_an_moe_policys_update_scores_tokens_as_the_rollout_and_the_reference_do(tmp_path: Path) -> None:
    """Experts with a tight capacity drop tokens in train mode only: the trainer's π_old then
    differed from the reference's π_ref computed from the very same weights (eval mode), and the
    KL term was not 0 before any step."""
    moe = {**MODEL, "moe": {"experts": 4, "capacityFactor": 0.3}}
    spec = {"virtualCluster": "x", "model": moe, "algorithm": {"name": "grpo", "groupSize": 2},
            "optimization": {"learningRate": 1e-9, "promptsPerStep": 1}}
    trainer = workers.PolicyTrainer(spec, None, str(tmp_path / "ckpt"), "cpu")
    with torch.no_grad():  # experts that matter, as trained ones do (at init their branch is tiny)
        for name, weight in trainer.model.named_parameters():
            if "experts" in name:
                weight.mul_(8.0)
    reference = workers.ReferenceWorker.__new__(workers.ReferenceWorker)
    reference.spec, reference.model = trainer.spec, copy.deepcopy(trainer.model).eval()
    prompt = list(b"Q: What is 2 + 3?\nA:")
    tokens = torch.tensor([list(b" 5 and then 7\n"), list(b" 9 or maybe 8\n")])
    item = {"prompt": prompt, "tokens": tokens, "mask": torch.ones(2, tokens.shape[1]),
            "advantages": torch.tensor([1.0, -1.0])}
    item["reference"] = reference.logprobs([item])[0]
    dropped = policy.response_logprobs(copy.deepcopy(trainer.model).train(), prompt, tokens)
    assert not torch.allclose(dropped, item["reference"], atol=0.1), "train mode drops tokens"
    metrics = trainer.update([item])
    assert metrics["kl"] < 1e-6  # 0.01 when the trainer scored in train mode


def test_the_controller_refuses_what_it_cannot_run_before_starting_ray(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "rl.json"
    config.write_text(json.dumps({"jobName": "rl", "runDir": str(tmp_path / "run"), "spec": {
        "virtualCluster": "x", "model": MODEL, "algorithm": {"name": "ppo"}}}))
    assert controller.main(["--config", str(config)]) == 2
    assert "spec.algorithm.name: ppo needs a critic" in capsys.readouterr().err
    assert controller.main(["--config", str(tmp_path / "missing.json")]) == 2
    assert f"cannot read run config {tmp_path / 'missing.json'}" in capsys.readouterr().err
    config.write_text("{not json")
    assert controller.main(["--config", str(config)]) == 2
    assert f"run config {config} is not valid JSON/YAML" in capsys.readouterr().err


def _spec(**roles: dict) -> rl.RLJobSpec:
    return rl.RLJobSpec.model_validate({"virtualCluster": "x", "model": MODEL, "roles": roles})


def test_a_role_of_zero_replicas_that_the_run_needs_is_refused_naming_the_field() -> None:
    """A rollout, or a reference for a KL term, of 0 replicas ran one actor anyway: the API
    counts no GPU for it, so on a GPU cluster it waited for one until the start timeout, whose
    error told the user to lower the replicas they had set to 0. Refused now, before anything
    starts (and, in the config file at run time, the roles are kept)."""
    with pytest.raises(ValueError, match=r"^spec\.roles\.rollout\.replicas: 0, .*set it to 1 or more"):
        controller.check_runnable(_spec(rollout={"replicas": 0}))
    with pytest.raises(ValueError, match=r"^spec\.roles\.reference\.replicas: 0, but spec\.algorithm "
                                         r"\(grpo\) has a KL term .*leave spec\.roles\.reference out"):
        controller.check_runnable(_spec(reference={"replicas": 0}))
    # without a KL term no reference runs, so 0 is what it runs
    dapo = _spec(reference={"replicas": 0}).model_copy(update={"algorithm": rl.AlgorithmSpec(name="dapo")})
    assert controller.role_replicas(dapo, controller.check_runnable(dapo))["reference"] == 0


def test_the_roles_run_the_replicas_the_spec_asks() -> None:
    grpo = _settings(name="grpo")
    assert controller.role_replicas(_spec(), grpo) == {"actorTrain": 1, "rollout": 1, "reference": 1,
                                                       "reward": 0}
    spec = _spec(actorTrain={"replicas": 3}, rollout={"replicas": 2}, reference={"replicas": 2},
                 reward={"replicas": 4})
    assert controller.role_replicas(spec, grpo) == {"actorTrain": 3, "rollout": 2, "reference": 2,
                                                    "reward": 4}
    assert controller.role_replicas(spec, _settings(name="dapo"))["reference"] == 0  # no KL term
    # reward 0 is no reward worker, scored in the controller as with no reward role (it ran one:
    # a merge patch to 0, the way back from N without a null, kept a worker the spec did not ask)
    assert controller.role_replicas(_spec(reward={"replicas": 0}), grpo)["reward"] == 0


def test_actors_that_cannot_start_are_refused_naming_their_roles_and_ray_is_shut_down(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU actors on a cluster without GPUs never start: exit 2 after startTimeoutS naming each
    role that did not start (spec.roles.<role>, how many of its actors did) and the fix. It named
    only "the roles' N actors" and "spec.roles' replicas"; and a refused start left the Ray
    cluster it had started (and its actors, still asking for GPUs) running in the caller."""
    import ray

    config = tmp_path / "rl.json"
    config.write_text(json.dumps({"jobName": "rl", "runDir": str(tmp_path / "run"), "rayCpus": 2,
                                  "device": "cuda", "startTimeoutS": 1, "evalPrompts": 0, "spec": {
                                      "virtualCluster": "x", "model": MODEL,
                                      "algorithm": {"name": "dapo"},  # no KL: no reference
                                      "roles": {"rollout": {"replicas": 2}, "reward": {"replicas": 1}}}}))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        assert controller.main(["--config", str(config)]) == 2
        err = capsys.readouterr().err
        # The reward worker needs no GPU, so it starts, but on a loaded host maybe not within the
        # second (CI, 2026-12-05: its actor was not up after 1 s): then it is named the same way.
        assert re.search(r"spec\.roles\.actorTrain \(0 of 1 started\) and spec\.roles\.rollout \(0 of 2 "
                         r"started\)( and spec\.roles\.reward \(0 of 1 started\))? did not start within 1 s "
                         r"on a Ray cluster of 2 CPU and 0 GPU", err), err
        assert "lower those roles' replicas or gpusPerReplica, or give the cluster more" in err, err
        assert not ray.is_initialized()
    finally:
        ray.shutdown()


def test_a_bad_config_file_keeps_the_roles_and_says_so_once_not_at_every_step(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The controller re-reads its config file at every step boundary; an edit it refuses kept
    the roles but printed its error again at every step (a line a step into the head pod's log
    until someone fixed the ConfigMap). Once per edit now, and again if it goes bad again."""
    config = tmp_path / "rl.json"

    def write(rollout: int) -> None:
        config.write_text(json.dumps({"jobName": "rl", "runDir": str(tmp_path / "run"), "spec": {
            "virtualCluster": "x", "model": MODEL, "roles": {"rollout": {"replicas": rollout}}}}))

    running = controller.Controller.__new__(controller.Controller)  # no Ray: only the file's part
    running.config_path, running.settings, running._trainer_gpus = config, _settings(name="grpo"), None
    write(0)
    assert running._wanted_replicas() is None and running._wanted_replicas() is None
    err = capsys.readouterr().err
    assert err.count("unusable, roles unchanged: spec.roles.rollout.replicas: 0") == 1, err
    write(2)
    assert running._wanted_replicas() == {"actorTrain": 1, "rollout": 2, "reference": 1, "reward": 0}
    write(0)
    assert running._wanted_replicas() is None
    assert capsys.readouterr().err.count("unusable") == 1


def test_an_init_checkpoint_that_is_not_there_is_refused_naming_the_field(tmp_path: Path) -> None:
    """The trainers' and references' constructors read spec.initCheckpoint; a path holding no
    checkpoint ended the start with "<path> holds no complete Huorn checkpoint", naming neither
    the field nor what to do."""
    model = training.ModelSpec.model_validate(MODEL)
    with pytest.raises(ValueError, match=r"^spec\.initCheckpoint: .*nowhere holds no complete Huorn "
                                         r"checkpoint.*; point it at .* or leave it out"):
        workers.build_policy(model, str(tmp_path / "nowhere"), 0, torch.device("cpu"))


def test_a_step_due_a_checkpoint_is_saved_before_the_roles_rescale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_cluster: dict[str, str]) -> None:
    """A rescale can fail (a trainer that joins dies before it has the group's state: the group
    is stopped and the controller run again from the last checkpoint). The step's checkpoint was
    written after the rescale, so such a failure at a step due one lost the step and every step
    since the checkpoint before; it is written first now, and the rerun resumes there."""
    import ray

    for name, value in ray_cluster.items():  # the controller connects; its actors go with it
        monkeypatch.setenv(name, value)
    cfg = controller.RLRunConfig.model_validate({
        "jobName": "rl", "runDir": str(tmp_path / "run"), "checkpointDir": str(tmp_path / "ckpt"),
        "evalPrompts": 0, "spec": {
            "virtualCluster": "x", "model": MODEL, "steps": 3,
            "algorithm": {"name": "lite-ppo", "groupSize": 2},
            "reward": {"type": "format", "dataset": "arithmetic-small"}, "rollout": {"maxNewTokens": 3},
            "optimization": {"promptsPerStep": 2}, "checkpoint": {"path": "/c", "intervalSteps": 2}}})

    def rescale(step: int) -> None:
        if step == 2:
            raise RuntimeError("a joining trainer died")

    try:
        running = controller.Controller(cfg)
        monkeypatch.setattr(running, "rescale", rescale)
        with pytest.raises(RuntimeError, match="a joining trainer died"):
            running.run()
    finally:
        ray.shutdown()
    latest = checkpoint.find_latest(tmp_path / "ckpt")
    assert latest is not None and checkpoint.read_meta(latest)["step"] == 2


def test_ray_cpus_for_a_running_cluster_is_refused_naming_both(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray itself refuses num_cpus for a cluster it connects to, naming neither setting."""
    config = tmp_path / "rl.json"
    config.write_text(json.dumps({"jobName": "rl", "runDir": str(tmp_path / "run"), "rayCpus": 2, "spec": {
        "virtualCluster": "x", "model": MODEL}}))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    assert controller.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rayCpus: 2 sizes a Ray cluster") and "RAY_ADDRESS=10.0.0.7:6379" in err, err
    assert "drop rayCpus, or unset RAY_ADDRESS" in err
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_the_roles_import_only_what_they_run() -> None:
    """Ray imports each actor's module in the actor's process, so its imports are the role's
    start-up cost: a reward worker needs no torch, nor do the groups it is sent (the whole items
    were, whose tensors imported it at the first call), and a rollout worker no DCP (1.2-1.4 s
    of CPU) until a checkpoint is saved or loaded."""
    groups = workers.RolloutWorker({"virtualCluster": "x", "model": MODEL}, "cpu").generate(
        [("Q: What is 2 + 3?\nA:", "5", 1)])
    sent = pickle.dumps(controller.reward_inputs(groups))
    probe = (
        "import sys, json, pickle\n"
        "from huorn.runtime.rl import rewarding\n"
        f"rewarding.RewardWorker({{'virtualCluster': 'x'}}).score(pickle.loads({sent!r}))\n"
        "reward_torch = 'torch' in sys.modules\n"
        "from huorn.runtime.rl import workers\n"
        f"workers.RolloutWorker({{'virtualCluster': 'x', 'model': {MODEL!r}}}, 'cpu')\n"
        "print(json.dumps([reward_torch, 'torch.distributed.checkpoint' in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=harness.REPO, env=harness.child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [False, False]


@pytest.mark.slow
def test_a_controller_run_over_ray_logs_every_step_and_resumes_from_its_checkpoint(
        tmp_path: Path, ray_cluster: dict[str, str]) -> None:
    spec = {"virtualCluster": "x", "model": MODEL, "steps": 3,
            "algorithm": {"name": "grpo", "groupSize": 4},  # GRPO: a KL term, so a reference worker
            "reward": {"type": "format", "dataset": "arithmetic-small"},
            "rollout": {"maxNewTokens": 6},
            "optimization": {"learningRate": 1e-3, "promptsPerStep": 4, "miniBatches": 2},
            "roles": {"rollout": {"replicas": 2}, "reward": {"replicas": 1}},
            "checkpoint": {"path": "/checkpoints", "intervalSteps": 3}}
    config = tmp_path / "rl.json"

    # Both runs drive one running cluster, as controllers do on a KubeRay cluster: RAY_ADDRESS
    # names it (the controller then neither starts nor sizes one), and the restarted controller
    # finds it again. `huorn run`'s RL test covers the controller starting its own. The module's
    # cluster, shared with its other controller tests: one start instead of one each.
    run_twice_on(tmp_path, spec, config, harness.child_env(**ray_cluster))


def run_twice_on(tmp_path: Path, spec: dict, config: Path, env: dict[str, str]) -> None:
    def run(steps: int) -> list[dict]:
        config.write_text(json.dumps({"jobName": "rl", "spec": {**spec, "steps": steps},
                                      "runDir": str(tmp_path / "run"),
                                      "checkpointDir": str(tmp_path / "ckpt"),
                                      "evalPrompts": 8}))
        done = subprocess.run([sys.executable, "-m", "huorn.runtime.rl.controller", "--config", str(config)],
                              cwd=harness.REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = (tmp_path / "run" / controller.STEPS_FILE).read_text().splitlines()
        return [json.loads(line) for line in lines]

    events = run(3)
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "eval", "rl", "rl", "rl", "checkpoint", "eval", "done"]
    start = events[0]
    assert start["reference"] and start["rollout_workers"] == 2 and start["reward_workers"] == 1
    for e in (e for e in events if e["event"] == "rl"):
        assert e["groups_trained"] == 4 and e["updates"] == 2 and 0 <= e["reward_mean"] <= 1
        assert 1 <= e["response_length"] <= 6 and e["kl"] >= 0
    assert [e["step"] for e in events if e["event"] == "rl"] == [0, 1, 2]

    # A longer run resumes after step 3. SIGTERM mid-run (a pod being stopped): the step in
    # flight ends, is saved as the newest checkpoint, and the run exits 0. On the default roles
    # (one rollout worker, scored in the controller): what a resume reads is the checkpoint, not
    # the roles, and each actor costs a process importing torch (the first run used five).
    port = _free_port()
    config.write_text(json.dumps({"jobName": "rl", "spec": {**spec, "steps": 500, "roles": {}},
                                  "runDir": str(tmp_path / "run"), "checkpointDir": str(tmp_path / "ckpt"),
                                  "evalPrompts": 0, "progressPort": port}))
    log = tmp_path / "run" / controller.STEPS_FILE
    seen = len(log.read_text().splitlines())
    process = subprocess.Popen([sys.executable, "-m", "huorn.runtime.rl.controller", "--config", str(config)],
                               cwd=harness.REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while sum('"event": "rl"' in line for line in log.read_text().splitlines()[seen:]) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.2)
    # What the operator reads on the head pod: the steps done, counting the resumed ones.
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=10) as answer:
        served = json.loads(answer.read())
    assert served["job"] == "rl" and served["steps"] == 500 and served["step"] >= 3 + 2
    assert 0 <= served["rewardMean"] <= 1
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 128 + signal.SIGTERM  # stopped, not finished: a pod's Failed
    after = [json.loads(line) for line in log.read_text().splitlines()[seen:]]
    assert after[0]["event"] == "start" and after[0]["resumed_from"] == 3
    assert next(e["step"] for e in after if e["event"] == "rl") == 3
    stopped = after[-1]
    assert stopped["event"] == "stopped" and stopped["signal"] == "sigterm"
    saved = after[-2]
    assert (saved["event"], saved["reason"], saved["step"]) == ("checkpoint", "sigterm", stopped["step"])
    assert max(e["step"] for e in after if e["event"] == "rl") == stopped["step"] - 1
    # The newest checkpoint is that step's: the next start resumes there (as this one did at 3).
    latest = checkpoint.find_latest(tmp_path / "ckpt")
    assert latest is not None and checkpoint.read_meta(latest)["step"] == stopped["step"]

    # A starting checkpoint of another architecture is refused, naming the field.
    wider = training.ModelSpec.model_validate({**MODEL, "width": 64})
    with pytest.raises(ValueError, match=r"^spec\.initCheckpoint: .*holds a model other than spec\.model"):
        workers.build_policy(wider, str(tmp_path / "ckpt"), 0, torch.device("cpu"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_progress_is_the_latest_state_of_the_step_log_over_http() -> None:
    state = progress.Progress("rl", 10)
    server = progress.ProgressServer(state, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}"
        state.record({"event": "start", "resumed_from": 4, "attempt": 2})  # the head's second run
        with urllib.request.urlopen(f"{url}/progress", timeout=10) as answer:
            assert json.loads(answer.read()) == {"job": "rl", "steps": 10, "step": 4, "attempt": 2}
        for record in ({"event": "rl", "step": 4, "reward_mean": 0.25}, {"event": "eval", "accuracy": 0.5},
                       {"event": "rl", "step": 5, "reward_mean": 0.75, "rollout_workers": 2},
                       {"event": "checkpoint", "step": 6, "path": "/c/6"}, {"event": "done", "step": 6}):
            state.record(record)
        with urllib.request.urlopen(f"{url}/progress", timeout=10) as answer:
            assert json.loads(answer.read()) == {
                "job": "rl", "steps": 10, "step": 6, "attempt": 2, "rewardMean": 0.75, "evalAccuracy": 0.5,
                "rolloutWorkers": 2, "lastCheckpoint": {"step": 6, "path": "/c/6"}, "done": True}
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{url}/metrics", timeout=10)
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_async_generation_overlaps_the_next_rollout_with_the_update(
        tmp_path: Path, ray_cluster: dict[str, str]) -> None:
    """spec.rollout.asyncSteps 1: step t+1's responses are generated with step t's weights while
    step t trains. Every step after the first lags one version; the loop waits only for what
    outlasts the update; the run ends, checkpoints and evaluates as a synchronous one does."""
    spec = {"virtualCluster": "x", "model": MODEL, "steps": 4,
            "algorithm": {"name": "lite-ppo", "groupSize": 4},  # no KL, no dynamic sampling
            "reward": {"type": "format", "dataset": "arithmetic-small"},
            "rollout": {"maxNewTokens": 6, "asyncSteps": 1},
            "optimization": {"learningRate": 1e-3, "promptsPerStep": 4, "miniBatches": 2},
            "roles": {"rollout": {"replicas": 1}},
            "checkpoint": {"path": "/checkpoints", "intervalSteps": 4}}
    config = tmp_path / "rl.json"
    config.write_text(json.dumps({"jobName": "rl", "spec": spec, "runDir": str(tmp_path / "run"),
                                  "checkpointDir": str(tmp_path / "ckpt"), "evalPrompts": 4}))
    env = harness.child_env(**ray_cluster)  # the module's cluster, of 2 CPUs
    done = subprocess.run([sys.executable, "-m", "huorn.runtime.rl.controller", "--config", str(config)],
                          cwd=harness.REPO, env=env, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "run" / controller.STEPS_FILE).read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["event"] for e in events] == ["start", "eval", *["rl"] * 4, "checkpoint", "eval", "done"]
    steps = [e for e in events if e["event"] == "rl"]
    assert [e["step"] for e in steps] == [0, 1, 2, 3] and [e["policy_lag"] for e in steps] == [0, 1, 1, 1]
    assert all(e["groups_trained"] == 4 and e["update_seconds"] > 0 for e in steps)
    # the first step waited for all of its rollout; the others only for what outlasted an update
    assert steps[0]["rollout_wait_seconds"] >= steps[0]["rollout_seconds"] * 0.99
    for e in steps[1:]:
        assert e["rollout_wait_seconds"] < e["rollout_seconds"], e
    assert checkpoint.read_meta(checkpoint.find_latest(tmp_path / "ckpt"))["step"] == 4  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_role_follows_the_config_file_between_steps(tmp_path: Path) -> None:
    """spec.roles.*.replicas in the config file (a ConfigMap in a cluster) is read at every step
    boundary: rollout, reference and reward workers are added, join once Ray has started them,
    and the surplus is stopped; training actors join the data-parallel group with its state and
    leave it; the job goes on meanwhile: no restart, every step once."""
    spec = {"virtualCluster": "x", "model": MODEL, "steps": 500,
            "algorithm": {"name": "grpo", "groupSize": 2},  # a KL term: reference workers
            "reward": {"type": "format", "dataset": "arithmetic-small"},
            "rollout": {"maxNewTokens": 4},
            "optimization": {"learningRate": 1e-3, "promptsPerStep": 4},
            "checkpoint": {"path": "/checkpoints", "intervalSteps": 1000}}
    config = tmp_path / "rl.json"
    port = _free_port()

    def write(train: int, rollout: int, reference: int, reward: int) -> None:
        roles = {"actorTrain": {"replicas": train}, "rollout": {"replicas": rollout},
                 "reference": {"replicas": reference}, "reward": {"replicas": reward}}
        config.write_text(json.dumps({"jobName": "rl", "spec": {**spec, "roles": roles},
                                      "runDir": str(tmp_path / "run"),
                                      "checkpointDir": str(tmp_path / "ckpt"), "evalPrompts": 0,
                                      # logical CPUs: room for every actor asked for below
                                      "rayCpus": 8, "progressPort": port}))

    write(1, 1, 1, 1)
    env = harness.child_env()
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "run" / controller.STEPS_FILE
    process = subprocess.Popen([sys.executable, "-m", "huorn.runtime.rl.controller", "--config", str(config)],
                               cwd=harness.REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)

    def events() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def wait_until(predicate: Any, what: str) -> None:
        deadline = time.monotonic() + 180
        while not predicate(events()):
            assert process.poll() is None, process.stderr.read()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    # each role one actor more (each model actor a process importing torch): enough to grow,
    # join and shrink; dealing a step over more workers is test_a_prompts_samples_do_not_...'s
    grown = {"actorTrain": 2, "rollout": 2, "reference": 2, "reward": 2}
    small = {"actorTrain": 1, "rollout": 1, "reference": 1, "reward": 1}
    try:
        wait_until(lambda es: sum(e["event"] == "rl" for e in es) >= 2, "two steps")
        write(*grown.values())
        wait_until(lambda es: any(e.get("role_replicas") == grown for e in es), "every role grown")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=10) as answer:
            served = json.loads(answer.read())
        assert served["rolloutWorkers"] == 2 and served["roleReplicas"] == grown
        write(*small.values())
        def shrunk(es: list[dict]) -> bool:
            first = min(x["step"] for x in es if x.get("role_replicas") == grown)
            return any(e.get("role_replicas") == small for e in es
                       if e["event"] == "rl" and e["step"] > first)

        wait_until(shrunk, "back to one")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
    seen = events()
    for role, most in grown.items():
        scales = [(e["from"], e["to"]) for e in seen if e["event"] == "scale" and e["role"] == role]
        assert scales[-1] == (most, 1) and any(to == most for _, to in scales), (role, scales)
        assert all(b >= a for a, b in scales[:-1]), scales  # up (maybe in steps as actors join), then down
    steps = [e for e in seen if e["event"] == "rl"]
    assert [e["step"] for e in steps] == list(range(len(steps)))  # one run, no restart, no step twice
    assert sum(e["event"] == "start" for e in seen) == 1
    # the update reports the group it ran on, and the loss stays finite through the hand-overs
    assert {e["trainers"] for e in steps} == {1, 2}
    assert all(math.isfinite(e["loss"]) for e in steps)


def test_a_prompts_samples_do_not_depend_on_the_worker_it_is_dealt_to() -> None:
    """Each prompt is sampled from its own seed, so dealing the step's prompts to one rollout
    worker or to three (as a live scale-up does) gives the same responses, in the same order."""
    from huorn.runtime.rl import pools

    spec = {"virtualCluster": "x", "model": MODEL, "algorithm": {"name": "grpo", "groupSize": 3},
            "rollout": {"maxNewTokens": 5}}
    worker = workers.RolloutWorker(spec, "cpu")
    prompts = [(p.text, p.answer, 7 * 65_536 + k)
               for k, p in enumerate(tasks.prompts("arithmetic-small", 0, 0, 5))]
    alone = worker.generate(prompts)

    chunks = pools.ActorPool("rollout", lambda: worker, 3).deal(prompts)  # the controller's dealing
    assert [len(c) for c in chunks] == [2, 2, 1]
    dealt = [item for chunk in chunks for item in worker.generate(chunk)]
    assert [i["responses"] for i in dealt] == [i["responses"] for i in alone]
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(dealt, alone, strict=True))
    assert len({tuple(i["responses"]) for i in alone}) > 1  # the prompts' seeds differ
