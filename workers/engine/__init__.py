"""The engine: requests, the scheduler, and the step loop that drives a model runner.

`llm_engine.LLMEngine` runs steps on the calling thread; `async_engine.AsyncEngine` runs
them on an engine thread for an event loop. No HTTP here, and the scheduler, requests and
sampling parameters import no torch.
"""
