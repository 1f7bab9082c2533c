"""tbajax: asynchronous off-policy LLM post-training with Trajectory Balance (TBA) in JAX."""

__version__ = "0.1.0"
