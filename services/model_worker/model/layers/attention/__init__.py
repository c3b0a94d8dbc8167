"""Paged attention: the step's metadata, one module per backend, and the dispatch between them."""
