"""What hardware: the GPUs visible at start, the devices a spec resolves to, ``CUDA_VISIBLE_DEVICES``."""
