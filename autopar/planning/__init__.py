"""Planning: ``CapturedGraph`` + ``MeshSpec`` + ``PlanOptions`` -> ``Plan``.

``shrink`` folds followers and shares identical layers, ``baselines`` costs the hand plans (DDP,
FSDP, Megatron TP...), ``planner`` builds the ILP from ``cost_models`` and solves it with
``solver``; ``symbolic`` re-costs a plan as formulas of batch and sequence length. Runs no
collective. Layer: above ``cost_models``, ``codegen`` and ``autopar.core``; below profiling and the API.
"""
