"""collating: see docs/architecture.md."""
