"""The Kubernetes backend: make an execution graph real as pods, a Service and a ConfigMap.

`manifests` builds the objects (pure functions, no API), `client` writes them idempotently and
`retry` is the backoff that every write goes through.
"""
