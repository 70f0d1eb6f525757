"""specbatch: lossless speculative decoding as a batch job system."""

__version__ = "0.1.0"
