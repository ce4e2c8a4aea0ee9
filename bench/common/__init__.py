"""Code the benchmark scripts share: :mod:`.timing` (candidates timed interleaved) and
:mod:`.environment` (what a result was measured on).

The scripts import it as ``common`` (``python bench/x.py`` puts ``bench/`` first on
``sys.path``), as they import the CPU benchmark's sections from ``cpu_perf``.
"""
