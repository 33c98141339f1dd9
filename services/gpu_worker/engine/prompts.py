"""Prompt embeddings, encoded off the generation pass and cached per prompt.

umT5-XXL takes tens of milliseconds per prompt on a GPU (far more on a CPU); run inside a pass
it would stall every session in the batch. So a prompt is encoded on its own thread as soon as
the worker hears of it (``request``, called from the event loop when a command arrives), and the
engine picks the embedding up at a chunk boundary once it is there (``ready``): a new session
waits out of the batch for its first prompt, a prompt change applies at the first boundary after
its encoding finished. Encoders that cost nothing (the hashing stand-in, ``inline = True``) run
in the caller, so the stand-in behaves exactly as before.

Embeddings are kept per prompt (LRU, ``cache_size`` prompts), without their padding rows.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..model.text import TextEncoder


class PromptEncoder:
    def __init__(self, encoder: TextEncoder, cache_size: int = 64) -> None:
        self.encoder = encoder
        self.inline = encoder.name == "hash"
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_size = cache_size
        self._pending: dict[str, Future[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._encode_ms: deque[float] = deque(maxlen=64)

    def request(self, prompt: str) -> None:
        """Starts encoding ``prompt`` unless it is cached or under way; never blocks on the
        encoder (except an inline one)."""
        with self._lock:
            if prompt in self._cache or prompt in self._pending:
                return
            if not self.inline:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="text-encoder")
                self._pending[prompt] = self._executor.submit(self._encode, prompt)
                return
        self._store(prompt, self._encode(prompt))

    def ready(self, prompt: str) -> torch.Tensor | None:
        """The ``[max_len, dim]`` embedding if it is done (requesting it if nobody had)."""
        self.request(prompt)
        with self._lock:
            hit = self._cache.get(prompt)
            if hit is not None:
                self._cache.move_to_end(prompt)
                return self._padded(hit)
            future = self._pending.get(prompt)
        if future is None or not future.done():
            return None
        self._store(prompt, future.result())  # raises the encoder's error, if any
        return self.ready(prompt)

    def get(self, prompt: str) -> torch.Tensor:
        """The embedding, waiting for it if need be."""
        self.request(prompt)
        with self._lock:
            future = self._pending.get(prompt)
        if future is not None:
            future.result()
        out = self.ready(prompt)
        assert out is not None
        return out

    def encode_ms(self) -> float | None:
        """Median time to encode one prompt (cache misses only)."""
        samples = list(self._encode_ms)
        return statistics.median(samples) if samples else None

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _encode(self, prompt: str) -> torch.Tensor:
        started = time.perf_counter()
        out = self.encoder.encode(prompt)
        self._encode_ms.append((time.perf_counter() - started) * 1000.0)
        return out

    def _store(self, prompt: str, embedding: torch.Tensor) -> None:
        rows = torch.nonzero(embedding.abs().sum(dim=1)).flatten()
        length = int(rows[-1]) + 1 if rows.numel() else 0
        with self._lock:
            self._pending.pop(prompt, None)
            self._cache[prompt] = embedding[:length].clone()
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.encoder.max_len, self.encoder.dim)
        out[: rows.shape[0]] = rows
        return out
