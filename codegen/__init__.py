"""Code generation: a ``Plan`` becomes readable Python for the sharded forward (``generate``),
run by ``ShardedModule`` (``module``) with the helpers in ``runtime``.

Layer: above ``autopar.core`` (the plan, the captured graph and ``execution``, which says how
each op runs), beside ``cost_models``; the API above compiles with it.
"""
