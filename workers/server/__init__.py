"""The worker process: one engine behind an OpenAI-compatible HTTP API (Litestar), its
state and admission, response building, tool calls, metrics and the entry point."""
