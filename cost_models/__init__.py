"""Cost model: what each op, placement change and training step costs, in seconds and bytes.

Layer: above ``autopar.core`` (whose graph, strategies and hardware presets it prices), beside
``codegen``; the planner above reads it. Units: seconds, bytes, bytes/s, FLOP/s (never mixed).
This package imports nothing on its own: import the module you need (``cost_models.estimate``).
"""
