"""Foreign servers behind the worker contract: one adapter per kind of server.

A pool's members are Switchyard workers (`switchyard`, with `/load`) or another engine's
OpenAI-compatible server: `vllm`, `sglang`, `llamacpp` (llama.cpp's llama-server), `tgi`,
`ollama`, or `openai` (any OpenAI-compatible base URL: a hosted API, another gateway). Each
adapter (`workers.api.upstreams.<kind>`) reads what that kind of server tells about itself
into one `UpstreamLoad` (`base`), says which of its answers mean "busy, try another", and
how to count a prompt with the server's own tokenizer. A figure a kind does not report is
None (unknown), never zero. `registry` maps a kind's name to its adapter and detects the
kind of an unknown server where one endpoint decides it unambiguously.

Like the rest of `workers.api`: no web framework, no torch; the HTTP comes from the caller
(a `Getter`/`Poster`, usually bound to a `WorkerClient` and the pool's upstream key).
"""
