"""Benchmarks: `mimo-epd bench <name>`. Each runs its modes side by side in one process run and prints
one JSON object with the raw figures and the ratios. Tests run their `--quick` form; they never
assert on time."""
