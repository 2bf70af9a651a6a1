"""Benchmarks: our pipeline side by side with the systems a user would pick instead."""
