"""The building blocks of a model, each with its weight loader: linear layers and their weight formats, norms, rotary, embedding."""
