"""Float64 NumPy references, one module per op (shared by tests, demo and benchmarks)."""
