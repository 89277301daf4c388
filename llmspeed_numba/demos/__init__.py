"""Demo cases, one module per op (see ``llmspeed_numba/_demo.py``)."""
