from __future__ import annotations

from typing import Any

import pytest
import torch

from services.gpu_worker.engine import Engine, EngineConfig, next_chunks


@pytest.fixture(autouse=True)
def _few_threads():
    # The machine is shared: keep each test on one intra-op thread.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(**overrides) -> Engine:
    settings: dict[str, Any] = {"preset": "tiny", "device": "cpu", "max_sessions": 4, "seed": 0}
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


def run_chunks(engine: Engine, session_id: str, count: int) -> list[torch.Tensor]:
    """``count`` chunks of every session; the given session's frames."""
    frames = []
    for _ in range(count):
        (result,) = [r for r in next_chunks(engine) if r.session_id == session_id]
        frames.append(result.frames)
    return frames


def solo(
    prompt_seed: tuple[str, int], count: int, prompts: dict[int, str] | None = None, **overrides
) -> list[torch.Tensor]:
    """The frames of one session generated alone on a fresh engine; ``prompts`` maps a
    chunk index to a prompt set just before that chunk."""
    prompt, seed = prompt_seed
    engine = make_engine(**overrides)
    engine.add_session("solo", prompt, seed)
    out = []
    for chunk in range(count):
        if prompts and chunk in prompts:
            engine.set_prompt("solo", prompts[chunk])
        out.extend(run_chunks(engine, "solo", 1))
    return out
