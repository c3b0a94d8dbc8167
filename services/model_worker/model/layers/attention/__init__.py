"""Paged attention: the step's layout and metadata, one module per backend, the pick for a device, the dispatch."""
