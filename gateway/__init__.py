"""gateway package (see docs/architecture.md)."""
