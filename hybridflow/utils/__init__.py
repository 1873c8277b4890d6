"""Small helpers shared across layers: tiny offline models for tests and the demo (`tiny_model`), and a
real pretrained one converted from a PyPI package's GGUF file (`real_model`)."""
