"""Running the gateway: the process entry point, a group of processes on one port, their
shared metrics, the HTTP server, and the embedded Redis."""
