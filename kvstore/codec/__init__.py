"""PQ codebooks (training, fingerprint, safetensors) and the transform applied before encoding."""
