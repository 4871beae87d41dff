"""Training data with no downloads: a byte-level tokenizer, corpora built from what installed
packages already carry, and a sampler whose order is a pure function of (seed, step, micro-batch)."""
