"""Small facts and helpers more than one service needs: the sampling fields on the wire, seed range, PEM files."""
from __future__ import annotations

# The sampling knobs of both GenerateRequests (gateway and worker protos), in proto order; each one
# left unset takes the checkpoint's generation_config default.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")
# Seeds are uint64 on the wire, and torch.Generator takes the whole range.
MAX_SEED = 2**64 - 1


def read_file(path: str | None) -> bytes | None:
    """A file's bytes (certificates and keys), or None when no path is given."""
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()
