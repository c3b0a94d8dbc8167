"""A checkpoint folder as the services read it: finding it (--model), checking it, and its shared JSON files."""
