"""Engine adapter: span grammar, injector, evaluator clients and engines."""

__all__: list[str] = []
