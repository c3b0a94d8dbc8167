"""The OpenAI-compatible HTTP front: FastAPI routes, request bodies and response shapes over the generation core."""
