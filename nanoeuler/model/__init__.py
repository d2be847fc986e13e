"""The model: its configuration and presets (config), the Engine that runs forward, backward and decoding
steps over either engine's layers (engine, decoding), the AdamW optimizer (optimizer), the choice of engine
(device), and the two engines' layers: cpu/ (numba, the reference) and gpu/ (CUDA kernels + cuBLAS)."""
