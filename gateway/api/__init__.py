"""The gateway's own HTTP API beside the OpenAI one: the admin API, tenant usage, the
learning router's labels and classifiers, and the built-in dashboard page."""
