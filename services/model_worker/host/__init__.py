"""Where the worker's processes and memory sit on the host: CPU affinity and huge pages."""
