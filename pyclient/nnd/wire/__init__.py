"""The wire layer: the connection to the daemon and its routes, values to and from nnd.v1 messages,
result streams and shared memory. Imports nothing of the layers above it (tracing, models, cli)."""
