"""The training side: verifiers that score rollouts, the code sandbox, and the GRPO/DPO
learner that trains the base model on q* rollouts. torch lives here and below, never in
`theory`, `engines` or `coordinator`.
"""
