"""Benchmark runner and accounting: tau, acceptance per position, tokens/s, speed-up."""
