"""quota package (see docs/architecture.md)."""
