"""Test doubles the tests and benchmarks use (never imported by the operator, the proxy or the CLI)."""
