"""Integrations with other training frameworks. Each lives in its own module and imports its framework only there,
so ``import accum_sched`` never imports them (``accum_sched.integrations.lightning`` needs the ``lightning`` extra).
"""
