"""warmup_ctl: the sidecar that plans and drives the warmup of inference_svc."""
