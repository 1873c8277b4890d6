"""Small helpers shared across layers: tiny offline models for tests and the demo (`tiny_model`), a
real pretrained one converted from a PyPI package's GGUF file (`real_model`), and loading a user's
object from a `file.py:Name` spec (`imports`); quieting library log lines no user can act on
(`library_noise`); the Auto class of a model with its language-model head, a vision-language model's included
(`lm_class`), and a tiny offline Qwen2.5-VL or Qwen3-VL (`tiny_vlm`)."""
