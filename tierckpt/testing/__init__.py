"""Shared test suites and helpers (``BackendTests``, S3 servers, a fault proxy)."""
