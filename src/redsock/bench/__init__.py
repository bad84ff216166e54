"""Benchmarks (``redsock bench``): runners that measure, and :mod:`.report` that prints.

Every runner produces :class:`redsock.results.Row` objects, one per message
size and implementation; :mod:`redsock.results` turns them into the
nccl-tests table, a side-by-side comparison against gloo measured in the same
run, JSON Lines (``--json``) and a plot.
"""
