"""The process boundary: the engine core in its own process, its async client, and the messages between them."""
