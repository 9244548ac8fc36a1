"""The lab around evald: the tools that measure or attack the product, kept out of its wheel.

* :mod:`evald_lab.fuzz` — ``evald fuzz``, the security fuzzer against a real daemon.
* :mod:`evald_lab.bench` — ``evald bench`` and ``engine-adapter bench``: what isolation costs.
* :mod:`evald_lab.study` — ``engine-adapter study``, the accuracy study.
* :mod:`evald_lab.demo` — ``make run``, the main job end to end.
* :mod:`evald_lab.gpu_check` — ``deploy/gpu-check.sh``, the SGLang adapter on a GPU.
* :mod:`evald_lab.harness` — ``evald serve`` as a child process (every tool and test uses it).
* :mod:`evald_lab.wat_corpus` — WAT modules built at run time (the fuzzer and the tests).

The product never imports this package; the commands reach the CLIs through entry points (the
``evald.commands`` and ``engine_adapter.commands`` groups in ``lab/pyproject.toml``).
"""

__all__: list[str] = []
