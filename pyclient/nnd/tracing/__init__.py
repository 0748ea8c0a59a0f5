"""The tracing layer: recording a block's graph (proxies, the graph, tracers, backends, sessions,
sync points, loops) and putting its results back into the caller's names. Imports the wire layer,
never models or cli at import time."""
