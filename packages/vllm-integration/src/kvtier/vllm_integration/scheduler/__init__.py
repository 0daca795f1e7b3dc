"""The scheduler half of ``KVTierConnector`` (EngineCore process, next to vLLM's scheduler):
request state, lookups and probes, the index of stored chunks, save planning, lazy offload,
block frees and KV events. It never waits on I/O inside ``schedule()``.
"""
