"""Node-local shared-memory embedding store shared by every encoder process of a node (numpy and the
standard library only). Lands with the shared-memory cache issue; until then each encoder keeps an
in-process LRU (encoder_server.embedding_cache)."""
