"""Benchmark harnesses and data generators behind `wsync bench`."""
