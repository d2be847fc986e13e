"""`nanoeuler check`: the float64 finite-difference check of every backward pass on the CPU engine
(gradients), the GPU kernels and model against the CPU engine (gpu), and the random problems both use
(problems)."""
