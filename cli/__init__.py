"""The `switchyard` command: the composition root of every process and tool."""
