"""One public request from its body to its settlement: intake (decode, authenticate,
price), the plan (pure), dispatch to a worker, relay of the stream or body, and the
flight that owns the request's quota and lease until it is settled."""
