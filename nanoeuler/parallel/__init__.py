"""Running as N ranks: which rank this process is and how the ranks meet (world.py), the collectives they
call (comm.py), and the launcher that `--gpus N` and `--nnodes` use (launch.py). Below train/ and eval/,
which both run on N ranks; it knows nothing of the model."""
