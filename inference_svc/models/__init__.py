"""Model loading and forward passes."""
