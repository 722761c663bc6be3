"""The measuring parts of the benchmark tools in `benchmarks/`: the scripts parse their options
and print; what they measure lives here, where the tests exercise it."""
