"""Benchmark programs behind ``rapydli bench``; one module per benchmark."""
