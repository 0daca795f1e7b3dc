"""A step's synchronous loads, copied layer by layer on a CPU the forward pass does not use.

On the CPU platform vLLM's cache is host memory and a synchronous load is a copy the forward
pass's core would make before the forward pass starts, the whole step waiting for it. Where the
worker has CPUs outside its binding (``kvtier.core.affinity``: with vLLM CPU's default binding,
the core it reserves for its front end), this thread makes the copy there instead: every load's
layer 0, then every load's layer 1, and so on, while each attention layer waits only for its own
layer (``wait_layer``, from vLLM's ``wait_for_layer_load``). The copy of layer i+1 runs while the
forward pass computes layer i, and the step waits for a layer's copy only where it is not done
yet. Each copy is one ``index_copy_`` per layer, which leaves the interpreter to the forward pass
while it runs.

A copy that raises fails its load only (the others go on); ``finish`` names those loads, and
their blocks are reported failed like a short load's (vLLM recomputes them and discards the
step's output of the request). Every wait is bounded: a copy not done within ``LAYER_WAIT_S``
fails every load of the batch the same way, and the worker copies inline until the thread is
free again (``busy``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

from kvtier.core.affinity import background

logger = logging.getLogger("kvtier")

#: The longest a forward pass waits for one layer's copy, or a step for its whole batch.
LAYER_WAIT_S = 30.0


class LayerPipe:
    """One thread advancing each submitted batch of layer-wise loads, layer by layer."""

    def __init__(self, num_layers: int) -> None:
        self._num_layers = num_layers
        self._cv = threading.Condition()
        self._queue: queue.Queue[list[tuple[str, Iterator[int]]] | None] = queue.Queue()
        self._running = False  # a batch was submitted and is not finished
        self._layers_done = 0  # of the running batch
        self._failed: set[str] = set()  # its loads whose copy raised
        self._seconds = 0.0  # how long its copy took, once finished
        self._thread = threading.Thread(
            target=background(self._loop), name="kvtier-layers", daemon=True
        )
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A batch is still copying (one whose step stopped waiting for it)."""
        with self._cv:
            return self._running

    def submit(self, loads: list[tuple[str, Iterator[int]]]) -> None:
        """Copy ``loads`` (a key and ``RetrieveJob.layers`` each); the pipe must not be busy."""
        with self._cv:
            assert not self._running, "a layer pipe runs one batch at a time"
            self._running, self._layers_done, self._failed = True, 0, set()
        self._queue.put(loads)

    def _loop(self) -> None:
        while True:
            loads = self._queue.get()
            if loads is None:
                return
            t0 = time.perf_counter()
            failed: set[str] = set()
            for layer in range(self._num_layers + 1):  # the last round ends every job
                for key, layers in loads:
                    if key in failed:
                        continue
                    try:
                        next(layers, None)
                    except Exception:  # its blocks are reported failed, never a crashed engine
                        logger.exception("kvtier: loading request %s failed", key)
                        failed.add(key)
                with self._cv:
                    self._layers_done = min(layer + 1, self._num_layers)
                    self._failed |= failed
                    if layer == self._num_layers:
                        self._running = False
                        self._seconds = time.perf_counter() - t0
                    self._cv.notify_all()

    def wait_layer(self, layer: int, timeout_s: float = LAYER_WAIT_S) -> bool:
        """Wait until the running batch's ``layer`` is copied (or the batch ended); whether it
        did within ``timeout_s``."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._running or self._layers_done > layer, timeout=timeout_s
            )

    def finish(self, timeout_s: float = LAYER_WAIT_S) -> tuple[bool, set[str], float]:
        """Wait for the running batch: (whether it ended within ``timeout_s``, the keys of its
        loads whose copy raised, how long its copy took)."""
        with self._cv:
            ended = self._cv.wait_for(lambda: not self._running, timeout=timeout_s)
            failed, self._failed = self._failed, set()
            return ended, failed, self._seconds

    def close(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
