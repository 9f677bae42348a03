"""Slurm-native launching: cluster profiles, sbatch rendering, the in-job driver, submitit submission."""
