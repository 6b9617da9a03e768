"""Measured comparisons (`switchyard bench …`): they report, they do not assert."""
