"""Training loop (GRPO / DPO on q* rollouts). Empty until the training issue lands."""
