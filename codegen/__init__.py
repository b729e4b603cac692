"""Code generation: a ``Plan`` becomes readable Python for the sharded forward (``generate``),
run by ``ShardedModule`` (``module``) with the helpers in ``runtime``."""
# codegen builds on autopar's stages, and autopar.compile on codegen: loading the autopar package
# first keeps every import order (``import codegen.generate`` alone included) free of cycles.
import autopar  # noqa: F401
