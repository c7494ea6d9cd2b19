"""The `kvtier bench ...` tools: benchmarks and trace replay, loaded lazily by server/cli.py only."""
