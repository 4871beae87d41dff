"""Pipeline-parallel training: schedule tables (GPipe, 1F1B, kFkB), an asynchronous
point-to-point executor, a memory model, a contention throttle, and the training loop with
adaptive k. See docs/pipeline.md."""

from huorn.runtime.pipeline.schedules import Action, Schedule, ScheduleError, build_schedule
from huorn.runtime.pipeline.training import (
    KPlanner,
    PipelinePlan,
    PipelineTraining,
    StepReport,
    run_pipeline_training,
)

__all__ = [
    "Action", "KPlanner", "PipelinePlan", "PipelineTraining", "Schedule", "ScheduleError", "StepReport",
    "build_schedule", "run_pipeline_training",
]
