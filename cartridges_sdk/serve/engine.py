"""The engine loop behind `cartridges serve`: one thread drives the runtime (engines are not thread-safe), requests
wait in a bounded queue, and the ones waiting together are answered as one heterogeneous batch (or, on a runtime
that takes requests mid-decode, join the running one). A batch that fails is run again in halves, so the request
that breaks it fails alone and the others get the answers they would have got alone (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from typing import Any

import attrs

from ..errors import BackendError, CartridgeError
from ..plugins import ContinuousRuntime, Runtime
from ..generation import Completion, GenerationRequest, settled_delta

log = logging.getLogger("cartridges_sdk.server")  # the name operators configure, kept from before serve/ existed


@attrs.define(eq=False)
class Job:
    request: GenerationRequest
    stream: bool
    loop: asyncio.AbstractEventLoop
    out: Any  # a Future (whole answers), or an asyncio.Queue of text pieces then the Completion (None if cut short)
    # or an exception
    cancelled: threading.Event = attrs.field(factory=threading.Event)


class Engine:
    """The one thread that drives the runtime. A `ContinuousRuntime` (vLLM, HF) gets each request as it arrives,
    streamed or not, and is stepped with up to `max_batch` in flight. Any other runtime answers the whole-answer requests
    waiting together in one batch, and a stream alone. Whatever goes wrong is handed to the requests it concerns; the
    thread itself keeps going."""

    def __init__(self, runtime: Runtime, max_queue: int, max_batch: int):
        self.runtime = runtime
        self.max_batch = max_batch
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self.largest_batch = 0  # the most requests answered together so far
        self.replayed = 0  # requests answered again, in smaller batches, because their batch failed
        self._active: dict[str, _Running] = {}  # the requests a continuous runtime holds, by handle
        self._suspects: deque[list[_Running]] = deque()  # halves of a failed batch, each run again on its own
        run = self._run_continuous if isinstance(runtime, ContinuousRuntime) else self._run
        self.thread = threading.Thread(target=run, name="cartridges-engine", daemon=True)
        self.thread.start()

    @property
    def in_flight(self) -> int:
        """Requests a continuous runtime holds now."""
        return len(self._active)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, job: Job) -> bool:
        if self._stopping.is_set():
            return False
        try:
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

    def close(self) -> None:
        self._stopping.set()
        try:
            self.jobs.put(None, timeout=1)  # wakes the thread if it waits for work
        except queue.Full:
            pass
        self.thread.join(timeout=60)

    def _run(self) -> None:
        held: Job | None = None  # a stream met while gathering a batch: it goes next
        while not self._stopping.is_set() or held is not None:
            job = held or self.jobs.get()
            held = None
            if job is None or job.cancelled.is_set():
                continue
            if job.stream:
                self._guarded([job], self._stream)
                continue
            batch = [job]
            while len(batch) < self.max_batch:
                try:
                    more = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    continue
                if more.stream:
                    held = more
                    break
                if not more.cancelled.is_set():
                    batch.append(more)
            self._guarded(batch, self._answer)
        self._turn_away()

    def _turn_away(self) -> None:
        while True:  # stopping: whoever still waits is told so
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _deliver(job, None, BackendError("The server is shutting down."))

    def _guarded(self, batch: list[Job], work) -> None:
        try:
            work(batch)
        except Exception as err:
            _log_failure(err, len(batch))
            for j in batch:
                _deliver(j, None, err)

    def _answer(self, batch: list[Job]) -> None:
        self.largest_batch = max(self.largest_batch, len(batch))
        try:
            outs = self.runtime.generate([j.request for j in batch])
            if len(outs) != len(batch):
                raise BackendError(f"The runtime answered {len(outs)} of {len(batch)} requests.")
        except Exception as err:
            if len(batch) == 1:
                raise
            # one request must never fail the others: each half is answered again on its own, and halved again
            # while it fails, so the failure reaches the request that causes it alone
            _log_failure(err, len(batch), again=True)
            self.replayed += len(batch)
            for half in _halves([j for j in batch if not j.cancelled.is_set()]):
                self._guarded(half, self._answer)
            return
        for j, out in zip(batch, outs):
            _deliver(j, out, None)

    def _stream(self, batch: list[Job]) -> None:
        (job,) = batch
        pieces = self.runtime.stream(job.request)
        final = None
        try:
            while not job.cancelled.is_set():  # until the client goes away: then decoding stops for it
                try:
                    _call(job.loop, job.out.put_nowait, next(pieces))
                except StopIteration as end:
                    final = end.value
                    if not isinstance(final, Completion):
                        raise BackendError(f"The runtime's stream ended without returning its Completion (got "
                                           f"{type(final).__name__}); see Runtime.stream.") from None
                    break
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
        _call(job.loop, job.out.put_nowait, final)

    def _run_continuous(self) -> None:
        active = self._active
        while not self._stopping.is_set():
            if not self._suspects:
                self._take_arrivals()
            elif not active:  # the halves of a failed batch run one after another, before anything new
                for running in self._suspects.popleft():
                    self._start(running)
            if not active:
                continue
            try:
                self._advance()
            except Exception as err:  # a failed step, or a runtime that broke its contract
                self._isolate(err)
        for handle in list(active):
            self._drop(handle, BackendError("The server is shutting down."))
        while self._suspects:
            for running in self._suspects.popleft():
                _deliver(running.job, None, BackendError("The server is shutting down."))
        self._turn_away()

    def _isolate(self, err: Exception) -> None:
        """After a failed step: a request that was alone is told; several are run again from the start, in two
        halves one after the other, and a half that fails is halved again, so the request that fails is told alone
        and the others get their answers. A stream goes on from the text it has already sent when the new answer
        begins with it (greedy decoding, seeded engines); otherwise it ends with an error rather than a spliced
        answer."""
        if len(self._active) == 1:
            _log_failure(err, 1)
            self._drop(next(iter(self._active)), err)
            return
        _log_failure(err, len(self._active), again=True)
        self.replayed += len(self._active)
        group = []
        for handle in list(self._active):
            running = self._active[handle]
            self._drop(handle)
            running.replayed = True
            group.append(running)
        self._suspects.extendleft(reversed(_halves(group)))  # extendleft reverses them back: the first half runs first

    def _start(self, running: _Running) -> None:
        """Hand a request to the runtime; one it refuses is told alone."""
        if running.job.cancelled.is_set():
            return
        try:
            self._active[self.runtime.add(running.job.request)] = running  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001 - refused (another model, too long): this request only
            _deliver(running.job, None, err)

    def _take_arrivals(self) -> None:
        """Add what has arrived to the runtime (waiting only when nothing is under way), up to `max_batch`."""
        while len(self._active) < self.max_batch:
            try:
                job = self.jobs.get_nowait() if self._active else self.jobs.get()
            except queue.Empty:
                break
            if job is None:  # woken to stop
                break
            self._start(_Running(job))
        self.largest_batch = max(self.largest_batch, len(self._active))

    def _advance(self) -> None:
        """One step of the runtime: new text to streams, finished answers to their requests; requests whose clients
        went away are dropped first."""
        for handle in [h for h, r in self._active.items() if r.job.cancelled.is_set()]:
            self._drop(handle)
        if not self._active:
            return
        for handle, completion, ended in self.runtime.step():  # type: ignore[attr-defined]
            running = self._active.get(handle)
            if running is None:
                continue
            job = running.job
            if job.stream and running.replayed and _diverged(running.shown, completion.text):
                self._drop(handle, BackendError(
                    "This answer cannot go on: another request failed the batch it was in, and answering it again "
                    "gave other text than was already sent. Ask again."))
                continue
            if job.stream and (delta := settled_delta(running.shown, completion.text, ended)):
                running.shown = completion.text
                _call(job.loop, job.out.put_nowait, delta)
            if ended:
                del self._active[handle]
                if job.stream:
                    _call(job.loop, job.out.put_nowait, completion)
                else:
                    _deliver(job, completion, None)

    def _drop(self, handle: str, error: BaseException | None = None) -> None:
        running = self._active.pop(handle)
        if error is not None:
            _deliver(running.job, None, error)
        try:
            self.runtime.abort(handle)  # type: ignore[attr-defined]
        except Exception:  # a failed abort must not stop the engine
            log.exception("Aborting a request failed")


@attrs.define
class _Running:
    """A request a continuous runtime holds, and the text its stream has shown so far."""

    job: Job
    shown: str = ""
    replayed: bool = False  # run again after its batch failed: its new text must agree with what was shown


def _diverged(shown: str, text: str) -> bool:
    """Whether a replayed answer's `text` departs from the `shown` one (an unfinished character at its end aside)."""
    text = text.rstrip("\ufffd")
    return not (text.startswith(shown) or shown.startswith(text))


def _halves(items: list) -> list[list]:
    """`items` in two halves, the first first (none empty): how a failed batch is run again."""
    mid = len(items) // 2
    return [half for half in (items[:mid], items[mid:]) if half]


def _log_failure(err: BaseException, count: int, again: bool = False) -> None:
    if again:
        log.warning("The runtime failed a batch of %d requests (%s: %s); running it again in halves", count,
                    type(err).__name__, err)
    elif isinstance(err, CartridgeError):  # refused by the runtime's own checks: the request's fault, said to it
        log.info("A request was refused: %s", err)
    else:
        log.error("The runtime failed %d request(s)", count, exc_info=err)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


def _deliver(job: Job, value: Any, error: BaseException | None) -> None:
    if job.stream:
        _call(job.loop, job.out.put_nowait, error if error is not None else None)
        if error is not None:
            _call(job.loop, job.out.put_nowait, None)
    else:
        _call(job.loop, _settle, job.out, value, error)


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
