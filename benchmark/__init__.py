"""Tools around the two training scripts, in four rooms: launch/, openai/, studies/, speed/ (benchmark/README.md).
Each tool runs from the repository root as a module, e.g. `python -m benchmark.speed.throughput --help`."""
