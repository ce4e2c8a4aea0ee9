"""The sections of ``bench/bench_cpu_perf.py``, one module per thing measured.

Modules import the benchmarks' shared code as ``common`` (``bench/common/``), so run them
through the scripts in ``bench/`` (``bench_cpu_perf.py``, ``ab.py``), which put
``bench/`` on ``sys.path``.
"""
