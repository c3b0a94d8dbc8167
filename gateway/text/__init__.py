"""The text pipeline: detokenizing as tokens arrive, stop strings, and the reasoning and tool-call parsers."""
