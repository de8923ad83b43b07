"""Benchmark CLI and pipeline builders."""
