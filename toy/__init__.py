"""The toy world the tests, the demo and the benchmarks run on: the toy task (`task.py`), its tokenizers and tiny models
(`tokenization.py`, `models.py`), their warm start (`sft.py`, `setup_models.py`) and the worlds built from them
(`world.py`). Runs from the checkout; not installed."""
