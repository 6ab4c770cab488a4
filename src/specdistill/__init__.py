"""specdistill: distil draft models for speculative decoding and measure them losslessly."""

__version__ = "0.1.0"
