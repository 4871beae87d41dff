"""A world of one reads its small batches from its accumulated micro-batches: two halves where it
can copy the gradients, else the first micro-batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from huorn.runtime import noise_scale, solo_noise


def accumulate(micro_grads: list[list[torch.Tensor]], reading: solo_noise.SoloReading) -> list[torch.Tensor]:
    """What the trainer's backward passes leave in .grad: (1/M)·Σ g_i, read after each."""
    m = len(micro_grads)
    acc = [torch.zeros_like(g) for g in micro_grads[0]]
    for done, grads in enumerate(micro_grads, start=1):
        for a, g in zip(acc, grads, strict=True):
            a.add_(g / m)
        reading.after_backward(done, acc)
    return acc


def sq(tensors: list[torch.Tensor]) -> float:
    return float(sum(t.double().pow(2).sum() for t in tensors))


def micro_gradients(m: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(3, 4, generator=gen, dtype=torch.float64),
             torch.randn(5, generator=gen, dtype=torch.float64)] for _ in range(m)]


def test_two_halves_read_what_two_ranks_of_half_the_batch_would() -> None:
    micro = micro_gradients(4)
    reading = solo_noise.SoloReading(4, micro_batch=2, copy_fits=True)
    total = accumulate(micro, reading)
    half_a = [(a + b) / 2 for a, b in zip(micro[0], micro[1], strict=True)]
    half_b = [(a + b) / 2 for a, b in zip(micro[2], micro[3], strict=True)]
    small_sq, b_small = reading.reading(total)  # type: ignore[misc]
    assert reading.mode == "halves" and b_small == 4.0
    assert small_sq == pytest.approx((sq(half_a) + sq(half_b)) / 2, rel=1e-9)
    assert reading.copy is None  # the copy is released with the step


def test_without_room_for_a_copy_or_with_an_odd_count_the_first_micro_batch_is_read() -> None:
    for m, room in ((4, False), (3, True)):
        micro = micro_gradients(m, seed=m)
        reading = solo_noise.SoloReading(m, micro_batch=2, copy_fits=room)
        total = accumulate(micro, reading)
        assert reading.mode == "first micro-batch" and reading.copy is None
        small_sq, b_small = reading.reading(total)  # type: ignore[misc]
        assert b_small == 2.0 and small_sq == pytest.approx(sq(micro[0]), rel=1e-9)


def test_the_room_asked_for_counts_every_parameter_that_trains() -> None:
    """An expert that the first micro-batch did not reach has no gradient then, but is copied at
    the half: counting the gradients present at the first micro-batch asked for 4,000 bytes and
    copied 40,000."""
    model = torch.nn.ModuleList([torch.nn.Linear(10, 100), torch.nn.Linear(100, 10)])
    model[0].bias.requires_grad_(False)
    assert solo_noise.gradient_bytes(model.parameters()) == (1000 + 1000 + 10) * 4


def test_a_parameter_without_gradient_in_the_first_half_counts_whole_in_the_second() -> None:
    """A mixture-of-experts expert that no token of the first half reached has no .grad yet."""
    reading = solo_noise.SoloReading(2, micro_batch=1, copy_fits=True)
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    reading.after_backward(1, [first / 2, None])
    total = [first / 2 + torch.tensor([0.5, 0.5]), second / 2]
    small_sq, _ = reading.reading(total)  # type: ignore[misc]
    assert small_sq == pytest.approx((1 + 4 + (1 + 1 + 9)) / 2)


def test_one_micro_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="two or more micro-batches"):
        solo_noise.SoloReading(1, micro_batch=8, copy_fits=True)


@pytest.mark.parametrize("reading", ["ranks", "halves", "first micro-batch"])
def test_each_reading_recovers_a_known_gradient_noise(reading: str) -> None:
    """Per-sample gradients G + ε, ε ~ N(0, σ²I): B_noise = d·σ²/|G|². Four ranks of 8 sequences
    each (the rank's gradient against the reduced one), or one rank's 8 micro-batches of 4."""
    rng = np.random.default_rng(1)
    dim, sigma, parts, part_size = 200, 0.5, 8, 4
    true = rng.normal(size=dim)
    expected = dim * sigma**2 / float(true @ true)
    estimator = noise_scale.NoiseScale(decay=0.99)
    for _ in range(400):
        samples = true + sigma * rng.normal(size=(parts, part_size, dim))
        if reading == "ranks":
            ranks = samples.reshape(4, -1, dim)
            small_sq = float(np.mean([np.sum(r.mean(axis=0) ** 2) for r in ranks]))
            big_sq = float(np.sum(samples.reshape(-1, dim).mean(axis=0) ** 2))
            estimator.update(small_sq, big_sq, parts * part_size / 4, parts * part_size)
            continue
        micro = [[torch.from_numpy(s.mean(axis=0))] for s in samples]
        solo = solo_noise.SoloReading(parts, part_size, copy_fits=reading == "halves")
        total = accumulate(micro, solo)
        small_sq, b_small = solo.reading(total)  # type: ignore[misc]
        estimator.update(small_sq, sq(total), b_small, parts * part_size)
    assert estimator.value == pytest.approx(expected, rel=0.15)
