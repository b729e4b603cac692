"""Measuring this host, above planning (calibration plans, compiles and trains zoo models):
``launch`` runs a function on local gloo processes (or all ranks in one process),
``measure`` times training steps and peak memory, ``profile_comm`` fits collectives and the
runtime's overheads, ``profiler`` profiles a model's ops and calibrates the cost model. The
result is a ``cost_models.profile.Profile`` that plans read.
"""
