"""The sections of ``bench/bench_cpu_perf.py``, one module per thing measured.

Modules import ``timing`` and ``bench_attention`` from ``bench/``, so run them through the
scripts there (``bench_cpu_perf.py``, ``ab_kernels.py``), which put ``bench/`` on ``sys.path``.
"""
