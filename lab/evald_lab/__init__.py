"""The lab around evald: the tools that measure or attack the product, kept out of its wheel.

* :mod:`evald_lab.fuzz` — ``evald fuzz``, the security fuzzer against a real daemon.
* :mod:`evald_lab.bench` — ``evald bench`` and ``engine-adapter bench``: what isolation costs.
* :mod:`evald_lab.study` — ``engine-adapter study``, the accuracy study.
* :mod:`evald_lab.demo` — ``make run``, the main job end to end.
* :mod:`evald_lab.gpu_check` — ``deploy/gpu-check.sh``, the SGLang adapter on a GPU.

The daemon as a child process and the WAT modules they run against it come from the product's
:mod:`evald.testing`, the real SGLang and vLLM servers from :mod:`engine_adapter.testing`: the
product's own tests use the same harness. The product never imports this package; the commands
reach the CLIs through entry points (the ``evald.commands`` and ``engine_adapter.commands``
groups in ``lab/pyproject.toml``).
"""

__all__: list[str] = []
