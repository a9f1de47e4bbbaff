"""The engine: a request's life from admission to its last token, built from its flags; the async front."""
