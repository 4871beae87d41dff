"""The starting weights of continual pre-training (`task.initCheckpoint`), found and checked
against `spec.model` when the trainer starts, before any process loads them; and the model a
saved checkpoint names, which a distillation teacher is read by too.

A checkpoint of another shape failed in DCP's load with a traceback and exit 1 (under `huorn run`,
a replacement a few seconds, for ever), and one of other `heads` loaded silently and computed
another function; a distillation teacher was checked this way already (huorn.runtime.distill).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from huorn.api import training
from huorn.runtime import checkpoint

FIELD = "spec.task.initCheckpoint"


def _shape(spec: training.ModelSpec) -> dict[str, object]:
    """What decides the weights' shapes and meaning: not the context (rotary positions hold no
    weights, and continual pre-training may lengthen it) nor MoE's routing settings."""
    return {"layers": spec.layers, "width": spec.width, "heads": spec.heads,
            "kvHeads": spec.kv_heads or spec.heads, "vocabulary": spec.vocabulary,
            "kvSharing": spec.kv_sharing.value,
            "moe": None if spec.moe is None
            else {"experts": spec.moe.experts, "prototypes": spec.moe.prototypes}}


def saved_model(location: str, field: str, whose: str) -> tuple[Path, training.ModelSpec]:
    """The newest complete checkpoint under `location` (the spec's `field`) and the model its
    huorn.json names, which a run reads before it loads weights of another run (`whose`: "base",
    "teacher"); ValueError naming the field and the fix otherwise."""
    try:
        path = checkpoint.resolve(Path(location))
    except ValueError as error:
        raise ValueError(f"{field}: {error}; point it at the {whose} run's checkpoint root") from None
    meta = checkpoint.read_meta(path)
    if "model" not in meta:
        raise ValueError(f"{field}: {path}/{checkpoint.META} names no model; it was not written by a Huorn "
                         "trainer, so its architecture is unknown")
    try:
        return path, training.ModelSpec.model_validate(meta["model"])
    except ValidationError as error:
        raise ValueError(f"{field}: the model in {path}/{checkpoint.META} is invalid: {error}") from None


def starting_checkpoint(location: str, model: training.ModelSpec) -> Path:
    """The newest complete checkpoint under `location`, if it holds a model of `model`'s shape;
    ValueError naming the field and the fix otherwise."""
    path, base = saved_model(location, FIELD, "base")
    there, here = _shape(base), _shape(model)
    differ = [f"{name} {there[name]} there, {here[name]} in spec.model" for name in here
              if there[name] != here[name]]
    if differ:
        raise ValueError(f"{FIELD}: {path} holds a model of another architecture ({'; '.join(differ)}); set "
                         "spec.model to the base run's, or start from a checkpoint of this architecture")
    return path
