"""The live conversations: each chain's open chat, kept under the id of the chain's latest response.

A Responses chain continues on the server without resending its history only while its chat is open here: the
chat holds the conversation's sequence (its KV cache on one replica). This registry owns those chats:

- **One chat per head.** :meth:`Chains.take` hands out the chat under a response id (and removes it), so one turn at
  a time continues a chain; :meth:`Chains.adopt` puts a chat back under its new head once the turn is stored.
- **Claims.** While a turn continues from a response (or a conversation), that id is claimed: a second request
  naming it meanwhile is refused with 409 instead of racing the first on the same sequence.
- **Bounded.** At most ``max_live`` chats are kept; beyond it, and after ``idle_s`` without a turn, the least
  recently used chat is closed (END frees its conversation on the server). Its chain is not lost: the store keeps
  its messages, and the next turn replays them into a fresh conversation (prefix blocks shared where they remain).
- **Room at the server's cap.** When the server refuses a new conversation at its cap, :meth:`Chains.close_oldest`
  closes the least recently used open chat at once, so idle chains never lock new users out.
- **Closing the gateway** detaches the chats (their conversations stay on the server for the model's idle timeout)
  when the store survives the gateway, so a restarted gateway resumes them; otherwise it closes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Final

from .._sessions import ChatSession

__all__ = ["Chains"]

#: How often idle chats are looked for.
SWEEP_S: Final = 5.0


class Chains:
    def __init__(self, *, max_live: int, idle_s: float, on_close: Callable[[str], Awaitable[None]]) -> None:
        # head response id -> (its open chat, when it was last used, the owner and model of the head response)
        self._live: OrderedDict[str, tuple[ChatSession, float, str, str]] = OrderedDict()
        self._claimed: set[str] = set()
        self._max_live = max_live
        self._idle_s = idle_s
        self._on_close = on_close  # told the head id of a chat closed here (the store forgets its resume state)
        self._closing: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._live)

    @property
    def claimed(self) -> int:
        return len(self._claimed)

    def claim(self, *keys: str | None) -> bool:
        """Claim every key given (None is skipped); False, claiming none, when one is claimed already."""
        wanted = [k for k in keys if k is not None]
        if any(k in self._claimed for k in wanted):
            return False
        self._claimed.update(wanted)
        return True

    def release(self, *keys: str | None) -> None:
        for k in keys:
            if k is not None:
                self._claimed.discard(k)

    def take(self, head: str) -> ChatSession | None:
        """The open chat whose latest response is ``head``, removed from the registry; None if none is live."""
        entry = self._live.pop(head, None)
        if entry is None:
            return None
        chat = entry[0]
        return chat if chat.is_open else None

    def peek(self, head: str, owner: str) -> tuple[ChatSession, str] | None:
        """The open chat under ``head`` and its model, when ``owner``'s (left in place): a turn continuing it needs
        no read of the store before its first token."""
        entry = self._live.get(head)
        if entry is None or entry[2] != owner or not entry[0].is_open:
            return None
        return entry[0], entry[3]

    def adopt(self, head: str, chat: ChatSession, *, owner: str, model: str) -> None:
        """Keep ``chat`` as the live conversation of the chain whose latest response is ``head``."""
        self._live[head] = (chat, time.monotonic(), owner, model)
        self._live.move_to_end(head)
        while len(self._live) > self._max_live:
            old, (oldest, *_) = self._live.popitem(last=False)
            self._close_later(old, oldest)
        if self._sweeper is None and self._idle_s > 0:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="triton-npu-openai-chains")

    async def forget(self, head: str) -> bool:
        """Close the live chat under ``head`` (its response was deleted); whether there was one."""
        entry = self._live.pop(head, None)
        if entry is None:
            return False
        await entry[0].aclose()
        return True

    async def close_oldest(self) -> bool:
        """Close the least recently used open chat now (the server is at its cap); whether there was one."""
        if not self._live:
            return False
        head, (chat, *_) = self._live.popitem(last=False)
        await chat.aclose()
        await self._on_close(head)
        return True

    def _close_later(self, head: str, chat: ChatSession) -> None:
        async def close() -> None:
            await chat.aclose()
            await self._on_close(head)

        task = asyncio.get_running_loop().create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_S, self._idle_s))
            now = time.monotonic()
            for head, (chat, used, *_) in list(self._live.items()):
                if now - used >= self._idle_s:
                    del self._live[head]
                    self._close_later(head, chat)

    async def aclose(self, *, detach: bool) -> list[tuple[str, ChatSession]]:
        """Stop the sweeper and end every live chat: detached (left on the server) or closed; returns them."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        chats = [(head, entry[0]) for head, entry in self._live.items()]
        self._live.clear()
        if not detach:
            await asyncio.gather(*(chat.aclose() for _, chat in chats), return_exceptions=True)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        return chats
