"""Which batches run on the event loop itself instead of on the model's thread.

Handing a batch to the model's thread and back costs more than a tiny model's call: a thread
wake-up, a wake-up of the event loop when the call is done, and the GIL changing hands twice
(py-spy: ``ThreadPoolExecutor.submit`` alone was 8 % of a worker serving the digits MLP, whose
call takes a few µs). A batch expected to take at most about ``INLINE_MAX_S`` runs inline;
anything slower, or a model not measured yet, keeps the thread so the loop never stalls on it.

Expected from what was measured, per model version (a new version may be slower): the most rows
a call was seen to finish within ``INLINE_MAX_S``. A batch of up to ``GROWTH`` times that many
rows runs inline, so a model whose calls grow with their rows is found out at about twice the
limit, once, and a request far bigger than the batches seen (a 250,000-row request) always
goes to the thread. What is timed is the model call itself (``BatchOutcome.infer_s``): joining
inputs and splitting outputs is Python holding the GIL on either thread, so only the call is
what running inline adds to the loop's stalls.

A call timed on the thread includes waiting for the GIL afterwards, up to the interpreter's
switch interval (5 ms) while the loop is busy, so a slow one says little about the model, and
only a quick one counts. A call timed inline holds the GIL throughout: a slow one shrinks the
row count in proportion at once, so the next batches of that size go back to the thread, and a
stall that was not the model's (the OS preempting the worker mid-call) is forgotten after the
next quick call of that size on the thread.
"""

from __future__ import annotations

INLINE_MAX_S = 0.0005
"""The longest a batch is meant to hold the event loop (a batch may reach about twice it)."""
GROWTH = 2
"""How many times the rows measured quick a batch may have and still run inline."""


class InlineCalls:
    """Per model: whether a batch of ``rows`` is expected to run within about ``max_s``."""

    def __init__(self, max_s: float = INLINE_MAX_S) -> None:
        self._max_s = max_s
        self._quick_rows: dict[str, int] = {}
        """Per version, the most rows a call was seen to finish within ``max_s``."""

    def suits(self, version: str, rows: int) -> bool:
        """Run a batch of ``rows`` of ``version`` inline (False until a call was quick)."""
        return rows <= GROWTH * self._quick_rows.get(version, 0)

    def observe(self, version: str, seconds: float, rows: int, *, inline: bool) -> None:
        """A call of ``version`` took ``seconds`` for ``rows`` rows, ``inline`` or on the
        model's thread."""
        quick = self._quick_rows.get(version, 0)
        if seconds <= self._max_s:
            if rows > quick:
                self._quick_rows[version] = rows
        elif inline:
            self._quick_rows[version] = min(quick, int(rows * self._max_s / seconds))
