"""The RL runtime of RLJobs: a ROLL-style single controller over Ray actors (controller.py),
the GRPO, DAPO and Lite PPO objectives (algorithms.py), sampling (policy.py) and verifiable
rewards (tasks.py)."""
