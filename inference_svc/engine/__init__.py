"""The engine: batching, warmup steps, the serving gate."""
