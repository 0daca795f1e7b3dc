"""The worker half of ``KVTierConnector`` (each worker process, next to the KV tensors): probes
and the holds they take, loads, saves, and the reports to the scheduler's index.
"""
