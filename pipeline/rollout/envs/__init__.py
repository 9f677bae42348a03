"""Example environments for multi-turn rollouts (rollout.generate_fn), each with a recipe under configs/."""
