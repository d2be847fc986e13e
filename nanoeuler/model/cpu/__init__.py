"""The CPU engine: numba layers (layers.py) driven by the shared nanoeuler.model.engine.Engine."""
