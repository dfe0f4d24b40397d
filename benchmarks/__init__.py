"""``python -m benchmarks``: this service against torch DataLoader, side by side in one run.

The machines this runs on are noisy (other work shares the cores), so every figure is a median over
repeats and every comparison is a ratio of contenders measured in the same run, never one absolute
time. See ``benchmarks/README.md`` for what each scenario measures and how to read the ratios.
"""
