"""The worker's contract: what other packages import from `workers`.

`types` (wire Structs and their decoders, no web framework), `validation` (request
bounds, pure), `client` (the gateway's client for one worker), `http1` (its HTTP/1.1
connection pool) and `sse` (the event-stream response). Import the module you need;
this package re-exports nothing, so importing the types pulls in no HTTP stack.
"""
