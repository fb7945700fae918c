"""Small reference models shared by tests, benchmarks, examples and the planner (plain `torch.nn` modules)."""

__all__: list[str] = []
