"""Test helpers that give the operator a Kubernetes API: the KMock emulator with its gaps filled."""
