"""Model execution: weights, the forward pass, attention over the paged KV, sampling, and
the native CPU kernels (`native/`). Only this package (and `tp`) runs torch kernels."""
