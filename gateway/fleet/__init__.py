"""The fleet: channels to the tokenizer and the model workers, their health and load, routing, and the shared worker streams."""
