"""Jinja templates shipped inside the wheel (slurm/*.sbatch.j2, k8s/*.yaml.j2)."""
