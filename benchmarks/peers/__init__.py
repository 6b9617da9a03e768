"""Peer servers and load generators run side by side with Switchyard in benchmarks.

`llama_server` builds llama.cpp's `llama-server` from a pinned source package and runs it;
`guidellm` installs GuideLLM into its own virtual environment and parses its reports.
Both cache under ``~/.cache/switchyard/peers/`` and never touch the project venv.
"""
