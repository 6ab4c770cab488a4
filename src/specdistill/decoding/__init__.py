"""Lossless speculative decoding: draft trees, verification rules, the generate loop, proposers."""
