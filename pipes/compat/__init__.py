"""compat: see docs/architecture.md."""
