"""The scheduling lab: simulator, workloads, baselines, training, evaluation and fine-tuning."""
