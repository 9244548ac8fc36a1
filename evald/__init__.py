"""evald: a gRPC daemon that runs evaluators compiled to WebAssembly under limits."""

__all__: list[str] = []
