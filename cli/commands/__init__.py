"""cli.commands."""
