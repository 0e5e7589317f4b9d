"""What the benchmarks share, and the tests with them: tables and JSON files (``output``),
interleaved medians (``timing``), runs in fresh processes (``processes``), gloo ranks on the
CPU (``ranks``) and training comparisons over several seeds (``seeds``).

Importable as ``harness`` wherever ``benchmarks/`` is on the path: a benchmark run as
``python benchmarks/X.py`` (its folder comes first), and pytest (``pythonpath`` in the root
``pyproject.toml``). Each module imports only what its own job needs, so the test helpers
that use ``harness.ranks`` run where only torch is installed.
"""
