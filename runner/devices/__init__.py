"""What hardware: the GPUs visible at start, the devices a spec resolves to, ``CUDA_VISIBLE_DEVICES``.

Devices are resolved in the driver, before any process starts CUDA, so that every process of a job sees the
same devices in the order the spec names them; the package never imports torch at its top.
"""
