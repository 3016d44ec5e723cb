"""inference_svc: a gRPC inference service for torch models, behind a warmup gate."""

__version__ = "0.2.0"
