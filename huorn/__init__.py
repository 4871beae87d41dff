"""Huorn: an operator for elastic training, RL and inference on shared GPU clusters."""

__version__ = "0.1.0"
