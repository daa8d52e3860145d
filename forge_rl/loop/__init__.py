"""The loop's parts that every group-based run shares: rollouts and admission (rollout.py), multi-turn rollouts
with an environment (multiturn.py), waiting for batches and moving the generators to a new version
(train_loop.py), checkpoints of a whole run (checkpoint.py), greedy held-out evaluation (eval.py) and the
behaviour policy check (sampling.py). The runs that use them are in forge_rl/recipes."""
