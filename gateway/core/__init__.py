"""The generation core: a request checked, encoded, sent to a worker, and its tokens turned into deltas."""
