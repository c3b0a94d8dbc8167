"""Requests in, steps out: the engine, its scheduler and block manager, and the sequences they track."""
