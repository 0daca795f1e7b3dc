"""The local-disk tier (``local_disk.LocalDiskBackend``) and its parts: file primitives (safe
opens, whole reads and writes: ``fileio``), O_DIRECT reads and writes (``direct``), a
directory's chunk files (``files``), the budget's bookkeeping (``index``), batched reads
(``readers``) and the store path (``writer``)."""
