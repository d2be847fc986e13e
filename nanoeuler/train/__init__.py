"""Training: the command skeleton of a run (run), the three stages as functions on it (pretrain, sft, dpo), their
typed options (options), --resume's rules (resume), the loop every stage shares (loop), what trains and in
which state (trainable), the objectives it optimizes (objectives), and data parallelism over ranks
(distributed)."""
