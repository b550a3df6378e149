"""The measuring code of each benchmark op (see ``vidsparse.bench.registry``)."""
