"""A turn's own stream interval (STREAM_INTERVAL_MS): the engine's pacing of mid-reply pieces, per request.

Engine-level checks ride test_chat_engine's rig (a tiny random GPT-2, a fake clock, no Triton).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_chat_engine import Rig, checkpoint  # noqa: F401  (the fixture is used by name)

from triton_npu_client.server.chat._chat import STREAM_INTERVAL_MAX_MS, TurnOptions

PROMPT = ["The cat sat on the mat."]


def test_a_turns_interval_wins_over_the_engines(checkpoint: Path) -> None:  # noqa: F811
    """The clock stands still: an interval sends the first piece, then the rest with the final response."""
    every = Rig(checkpoint).turn(1, ["user"], PROMPT, max_tokens=20, min_tokens=20)
    assert len(every.chat) == 20
    # An engine that streams every pass; the turn asks for one piece a second.
    paced = Rig(checkpoint).turn(1, ["user"], PROMPT, max_tokens=20, min_tokens=20, stream_interval_ms=1000)
    assert paced.reply == every.reply
    assert len(paced.chat) == 2
    # An engine with a 1 s default; the turn asks for every token (0), its next turn leaves it to the engine.
    rig = Rig(checkpoint, stream_interval_s=1.0)
    eager = rig.turn(1, ["user"], PROMPT, max_tokens=20, min_tokens=20, stream_interval_ms=0)
    assert eager.reply == every.reply
    assert len(eager.chat) == 20
    default = rig.turn(2, ["user"], PROMPT, max_tokens=20, min_tokens=20)
    assert len(default.chat) == 2


@pytest.mark.parametrize("value", [-1, STREAM_INTERVAL_MAX_MS + 1])
def test_an_out_of_range_interval_is_refused_naming_the_input(checkpoint: Path, value: int) -> None:  # noqa: F811
    rig = Rig(checkpoint)
    with pytest.raises(ValueError, match=rf"STREAM_INTERVAL_MS must be in 0\.\.60000 milliseconds, got {value}"):
        rig.engine.parse(start=True, end=False, roles=["user"], texts=PROMPT, stream_interval_ms=value)
    with pytest.raises(ValueError, match=r"stream_interval_s must be in 0\.\.60 seconds"):
        TurnOptions(max_tokens=1, stream_interval_s=value / 1000)
