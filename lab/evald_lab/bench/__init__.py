"""Benchmarks behind ``evald bench``: what isolation costs, and whether decoding ever waits.

* :mod:`evald_lab.bench._overhead` — ``evald bench overhead``: per-evaluation latency and throughput
  of every path (Python reference, in-process WASM, the daemon over UDS/TCP, unary, batched,
  streaming) side by side in one run.
* ``evald bench decode`` delegates to ``evald_lab.bench.decode`` (the local CPU engine with
  spans, the tool-call baseline and the batch stall), imported only when that command runs:
  data flows engine → adapter → client → daemon, so ``evald`` never imports the adapter at
  import time.
* :mod:`evald_lab.bench._headline` — the headline ratios of both, as a table for the README.

Results go to ``reports/bench/`` as JSON plus a matplotlib plot. The GPU variant of the decode
benchmark (SGLang, several batch sizes) is ``deploy/gpu-check.sh``.
"""

__all__: list[str] = []
