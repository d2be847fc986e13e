"""Training: the loop every stage shares (loop), the objectives it optimizes (objectives), the command
skeleton of a run (run), the three stages as hooks on it (pretrain, sft, dpo), and data parallelism over
ranks (distributed, launch)."""
