"""Hand-written example models used by the zoo (:mod:`autopar.models.zoo`), tests and benchmarks."""

from autopar.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
