"""Remediation: find hung and fail-slow ranks (C4, FALCON) and decide what to do about them.

Everything here is a pure function of telemetry the operator hands in; nothing talks to
Kubernetes or to the pods. Decisions come out as plain objects that the graph turns into
mutations, so the same code runs live, on recorded traces (`huorn detect`) and in the simulator.
"""
