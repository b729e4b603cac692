"""The compiler's core data, below every other stage: capture (``torch.export`` -> ``CapturedGraph``),
sharding rules and candidate strategies per node, the ``Plan`` they end in, the mesh and hardware
descriptions, errors and units, and ``execution``: how each op runs and which collective each
placement change is (read by the cost model and the code generator alike).

Imports only torch and the solver-free parts of itself; nothing here loads on ``import autopar.core``.
"""
