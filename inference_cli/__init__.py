"""inference_cli: a client of the Inference API and a grpc.health.v1 probe (`inference-cli`)."""
