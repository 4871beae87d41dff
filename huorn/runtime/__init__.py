"""What runs inside a pod (or a local replica): the elastic trainer and its data, checkpoints,
telemetry and fault injection, the torchrun launcher, and the pipeline executor. It may import
huorn.models and huorn.api, never the control plane; see docs/runtime.md."""
