"""The gateway: public gRPC and OpenAI-compatible HTTP fronts over one generation core, in front of the tokenizer and the model workers."""
