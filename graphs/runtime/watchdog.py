"""Worker liveness: a dead worker process raises a clear error instead of hanging the loader.

torchdata 0.11's ``ParallelMapper`` waits forever when one of its worker processes dies (an
OOM kill, a segfault in an image decoder, ``kill -9``): the item that worker held never
arrives. ``WorkerWatchdog`` polls the workers of every ``ParallelMapper`` in a graph and, when
one has died, hands the mapper an error in place of the missing item, so the trainer sees

    RuntimeError: neatpack: worker process 4242 of ParallelMapper died with exit code -9
    (SIGKILL: often the out-of-memory killer) ...

within about a second. The reverse case, the main process killed while its workers live on,
is handled by :func:`die_with_parent`, which each worker calls on its first item.

Stopping a graph (:func:`stop_graph`: ``close()``, a new ``iter()``, a dropped loader,
interpreter exit) stops its threads first and its worker processes only after them: a worker
that exits while a thread still receives its item breaks that thread (see :func:`stop_graph`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from torch._utils import ExceptionWrapper
from torchdata.nodes import BaseNode

__all__ = [
    "STOP_TIMEOUT_S",
    "WorkerWatchdog",
    "die_with_parent",
    "graph_threads",
    "init_worker",
    "keep_freed_memory",
    "mapper_iters",
    "quiet_forked_iterator_gc",
    "report_send_failures",
    "shutdown_at_exit",
    "stop_graph",
]

_PR_SET_PDEATHSIG = 1
_armed_pid: int | None = None


def die_with_parent(owner_pid: int) -> None:
    """In a worker process (pid != ``owner_pid``), ask Linux to SIGKILL it when its parent dies.

    Cheap after the first call in a process; does nothing in the owner process itself.
    """
    global _armed_pid
    pid = os.getpid()
    if _armed_pid == pid or pid == owner_pid:
        return
    _armed_pid = pid
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to arm
        return
    if os.getppid() == 1:  # the parent died before we armed: go now
        os._exit(1)


def init_worker(owner_pid: int) -> None:
    """First thing on every item in a worker process (pid != ``owner_pid``); cheap after the first.

    Arms :func:`die_with_parent` and, once per process:

    * sets torch to one intra-op thread, as ``torch.utils.data.DataLoader`` does in its workers:
      N workers each running torch's default of one thread per core would oversubscribe the
      cores N times over (resize, normalize and the pixel copies are all torch ops);
    * keeps freed memory for reuse (:func:`keep_freed_memory`);
    * turns a batch its queue cannot send into an error for the trainer
      (:func:`report_send_failures`).
    """
    first = _armed_pid != os.getpid()
    die_with_parent(owner_pid)
    if first and os.getpid() != owner_pid:
        import torch

        torch.set_num_threads(1)
        keep_freed_memory()
        report_send_failures()


def report_send_failures() -> None:
    """In a worker process: a result that its queue fails to send (pickle it, write it) reaches
    the trainer as an error naming the batch, in its place, instead of being dropped.

    ``multiprocessing`` pickles what a worker puts on its queue later, in a feeder thread; on
    failure it prints the traceback and drops the item, and torchdata's in-order trainer side
    then waits for that item forever (a ``BlockMask`` with a local mask function did this on
    every batch). ``Queue._on_queue_feeder_error`` is the hook for this (``concurrent.futures``
    overrides it to fail the call); set here as a plain function it is bound to the queue, so
    it can put the error where the item was due: ``(error, idx)``, torchdata's item form.
    Only worker processes call this (``init_worker``), before their first put.
    """
    from multiprocessing import queues

    if queues.Queue._on_queue_feeder_error is not _send_failed:  # type: ignore[attr-defined]
        queues.Queue._on_queue_feeder_error = _send_failed  # type: ignore[attr-defined]


class _SendError(ExceptionWrapper):
    """The error a worker sends in place of a batch it could not send."""


def _send_failed(q: Any, exc: Exception, obj: Any) -> None:
    item = obj[0] if isinstance(obj, tuple) and len(obj) == 2 else None
    if item is None or not isinstance(obj[1], int) or isinstance(item, _SendError):
        # not a torchdata item, or the error itself failed (the pipe is gone): print it, as
        # multiprocessing does, rather than try again
        traceback.print_exception(exc)
        return
    idx = obj[1]
    batch = getattr(item, "rest", item)  # a TransferBatch carries its non-tensor values there
    packs = batch.get("packs") if isinstance(batch, dict) else None
    where = "its batch"
    if isinstance(packs, list) and packs and all(isinstance(m, dict) for m in packs):
        slots = [m.get("slot") for m in packs]
        where = f"its batch (epoch {packs[0].get('epoch')}, pack slots {slots})"
    bad = _unpicklable_keys(batch) if isinstance(batch, dict) else []
    what = f": {', '.join(bad)} cannot be pickled" if bad else ""
    try:
        raise RuntimeError(
            f"neatpack: worker process {os.getpid()} could not send {where} to the trainer"
            f"{what} ({type(exc).__name__}: {exc}). Every value a step or hook puts in a "
            "batch must pickle to leave a worker: use module-level functions and classes (not "
            "local ones or lambdas), no locks or open files; or set num_workers=0."
        ) from exc
    except RuntimeError:
        origin = f"sending a batch from worker process {os.getpid()}"
        wrapped = _SendError(where=origin)  # type: ignore[no-untyped-call]
    q.put((wrapped, idx))


def _unpicklable_keys(batch: dict[Any, Any]) -> list[str]:
    """``batch[key] (type)`` for each value that does not pickle, tensors left out (the queue's
    pickler moves those into shared memory; checking them here would do it twice)."""
    import io
    import pickle

    import torch

    class _NoTensors(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            return (tuple, ()) if isinstance(obj, torch.Tensor) else NotImplemented

    bad = []
    for key, value in batch.items():
        try:
            _NoTensors(io.BytesIO()).dump(value)
        except Exception:  # any failure names the key
            bad.append(f"batch[{key!r}] ({type(value).__name__})")
    return bad


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
KEEP_FREED_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """In a loader worker: serve large allocations from the heap and keep what is freed.

    Every pack allocates tens of MB of pixel tensors (decode, resize, patches, the batch), and
    glibc gives each allocation over its mmap threshold fresh pages from the kernel and hands
    them back on free, so the next pack faults every page in again, zeroed. Measured here with
    2 workers (``neat_vlm_graph``, pack 4096, B=2): a third of the workers' CPU was page-fault
    system time, and turning mmap off (``M_MMAP_MAX=0``) with a 1 GiB trim threshold raised
    real tokens/s by about 1.6x. The cost is that a worker holds up to its peak heap plus
    ``KEEP_FREED_BYTES`` instead of returning memory between packs; its peak RSS stays within
    a few percent (measured), so there is no switch (``NEATPACK_WORKER_MALLOC`` is retired:
    ``pipes/compat/retired_env.py``). Only worker processes call this (never the trainer's).
    Returns whether the settings were applied (glibc only).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
        return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES) == 1)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False


_exit_roots: Any = None
#: How long closing a graph waits for its background threads: the batch in flight is finished
#: first (a prefetch thread cannot be interrupted inside torch), seconds for large packs.
STOP_TIMEOUT_S = 60.0
# Threads told to stop that were still finishing their item; joined at interpreter exit.
_lingering: set[threading.Thread] = set()
_lingering_lock = threading.Lock()


def _shutdown_all() -> None:
    """At interpreter exit: stop every graph's threads and worker processes, and wait for them.

    A daemon thread still running when the interpreter finalizes is killed by ``pthread_exit``
    the next time it takes the GIL; inside a torch op (a prefetch thread building a batch) that
    unwinds through C++ and aborts the process: "terminate called without an active exception",
    exit code 134. So every thread is joined here, before finalization, threads first and worker
    processes after them as :func:`stop_graph` explains (with the reapers of graphs dropped
    earlier). Each mapper iterator is also dropped from its node, so its ``__del__`` does not run
    during teardown, after ``multiprocessing``'s globals are gone.
    """
    roots = list(_exit_roots or ())
    for root in roots:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            stop_graph(root, timeout=STOP_TIMEOUT_S)
    for root in roots:
        for owner, name, it in _mapper_slots(root):
            with contextlib.suppress(Exception):
                it._shutdown()
                setattr(owner, name, None)
    _join(_take_lingering(), STOP_TIMEOUT_S)


def shutdown_at_exit(root: BaseNode[Any]) -> None:
    """Stop the threads and worker processes of ``root``'s graph at interpreter exit (held
    weakly); see :func:`_shutdown_all`. Without it a script that takes one batch and exits
    aborts in about half the runs (the prefetch thread is inside torch), and torchdata 0.11's
    ``_ParallelMapperIter.__del__`` prints "Exception ignored in ... AttributeError: 'NoneType'
    object has no attribute 'maxsize'" during teardown. ``atexit`` handlers run before both.
    """
    global _exit_roots
    if _exit_roots is None:
        import atexit
        import weakref

        _exit_roots = weakref.WeakSet()
        atexit.register(_shutdown_all)
    _exit_roots.add(root)


def _take_lingering() -> list[threading.Thread]:
    with _lingering_lock:
        threads = list(_lingering)
        _lingering.clear()
    return threads


def _join(threads: list[threading.Thread], timeout: float) -> list[threading.Thread]:
    """Join ``threads`` within one shared ``timeout``; those still alive go to ``_lingering``."""
    deadline = time.monotonic() + timeout
    alive: list[threading.Thread] = []
    for t in threads:
        if t is threading.current_thread() or not t.is_alive():
            continue
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            alive.append(t)
    with _lingering_lock:
        _lingering.difference_update([t for t in _lingering if not t.is_alive()])
        _lingering.update(alive)
    return alive


def graph_threads(root: BaseNode[Any]) -> list[threading.Thread]:
    """The live background threads of ``root``'s graph: prefetch / pin-memory threads, and each
    ``ParallelMapper``'s reader, sort and (``method="thread"``) worker threads."""
    threads, _ = _signal_threads(root, stop=False)
    return [t for t in threads if t.is_alive()]


def _signal_threads(root: BaseNode[Any], *, stop: bool) -> tuple[list[threading.Thread], list[Any]]:
    """The graph's background threads and its ``_ParallelMapperIter`` objects; with ``stop``,
    each thread is told to stop (the worker processes are not: see :func:`stop_graph`)."""
    threads: list[threading.Thread] = []
    mappers: list[Any] = []
    for _, _, obj in _walk(root):
        if hasattr(obj, "_stop_event") and hasattr(obj, "_thread"):  # Prefetcher, PinMemory
            if stop:
                obj._stop_event.set()
            threads.append(obj._thread)
        elif hasattr(obj, "_workers") and hasattr(obj, "_out_q"):  # a ParallelMapper
            if stop:
                obj._stop.set()
            mappers.append(obj)
            for name in ("_read_thread", "_sort_thread"):
                t = getattr(obj, name, None)
                if isinstance(t, threading.Thread):
                    threads.append(t)
            threads.extend(w for w in obj._workers if isinstance(w, threading.Thread))
    return threads, mappers


def _stop_workers(mappers: list[Any]) -> None:
    """Tell the worker processes of ``mappers`` to stop (each finishes the items queued to it)."""
    for it in mappers:
        with contextlib.suppress(Exception):  # a mapper torn down half-way: nothing to stop
            it._mp_stop.set()


def _reap(threads: list[threading.Thread], mappers: list[Any], timeout: float) -> None:
    """The body of a ``timeout=0`` :func:`stop_graph`'s reaper thread: wait for ``threads``
    (at most ``timeout`` s), then stop the worker processes and let go of ``mappers`` (their
    ``__del__`` joins the workers here, not in the thread that dropped the loader)."""
    try:
        _join(threads, timeout)
    finally:
        _stop_workers(mappers)
        mappers.clear()
        with _lingering_lock:
            _lingering.discard(threading.current_thread())


def stop_graph(root: BaseNode[Any], timeout: float = STOP_TIMEOUT_S) -> list[threading.Thread]:
    """Tell every background thread of ``root``'s graph to stop, wait up to ``timeout`` seconds
    for them (each finishes the item it is building), and only then tell the worker processes
    to stop. Returns the threads still alive; they are joined again at interpreter exit.
    Idempotent.

    The order matters. A ``ParallelMapper``'s sort thread (neatpack's graphs run in order)
    receives each item from a worker process, and torch sends the item's tensors as file
    descriptors: unpickling a tensor connects to the *sending worker's* resource sharer. Stop
    the workers at the same moment as the threads (torchdata's own ``_shutdown`` does) and a
    worker can exit while the sort thread is still receiving its last item: "Exception in
    thread (_sort_worker) ... rebuild_storage_fd ... ConnectionResetError" (or ``EOFError``,
    ``FileNotFoundError``), printed by a loader dropped mid-epoch. Threads poll their stop
    event every 0.1 s and finish the item they are receiving, so they are gone soon after;
    workers stopped only then leave no thread mid-receive.

    ``timeout=0`` (a loader or iterator dropped, ``break``) must not block the caller: a small
    daemon reaper thread holds the graph's mapper iterators (so torchdata's ``__del__``, which
    stops workers and threads together, cannot run early), waits for the threads up to
    ``STOP_TIMEOUT_S``, then stops the workers. Every wait is bounded: a thread still alive
    at the deadline does not keep the workers running.

        stop_graph(loader.root)       # close(), the next iter(): threads, then workers
        stop_graph(loader.root, 0.0)  # a dropped loader: returns now, a reaper does the rest
    """
    threads, mappers = _signal_threads(root, stop=True)
    if timeout > 0:
        alive = _join(threads, timeout)
        _stop_workers(mappers)
        return alive
    alive = _join(threads, 0.0)
    if not alive:
        _stop_workers(mappers)
        return alive
    reaper = threading.Thread(
        target=_reap, args=(alive, mappers, STOP_TIMEOUT_S), name="neatpack-stop", daemon=True
    )
    reaper.start()  # started first: a thread not yet started looks finished to _join
    with _lingering_lock:  # interpreter exit joins it (_shutdown_all)
        _lingering.add(reaper)
    return alive


_CHILD_ATTRS = ("source", "_it", "root", "_source")


def _walk(root: BaseNode[Any]) -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, child)`` for every object reachable from ``root`` through the
    attributes nodes and torchdata's iterators keep their children in."""
    found: list[tuple[Any, str, Any]] = []
    seen: set[int] = {id(root)}
    stack: list[Any] = [root]
    while stack:
        obj = stack.pop()
        for name in _CHILD_ATTRS:
            child = getattr(obj, name, None)
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            found.append((obj, name, child))
            stack.append(child)
    return found


def _mapper_slots(root: BaseNode[Any]) -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, iterator)`` for each live ``_ParallelMapperIter`` under ``root``."""
    return [
        (owner, name, child)
        for owner, name, child in _walk(root)
        if hasattr(child, "_workers") and hasattr(child, "_out_q")
    ]


def mapper_iters(root: BaseNode[Any]) -> list[Any]:
    """The live ``_ParallelMapperIter`` objects in the graph under ``root``."""
    return list({id(it): it for _, _, it in _mapper_slots(root)}.values())


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ": often the out-of-memory killer" if -code == signal.SIGKILL else ""
        return f"exit code {code} ({name}{hint})"
    return f"exit code {code}"


class WorkerWatchdog:
    """Polls the worker processes of a graph every ``interval`` seconds while it runs."""

    def __init__(self, root: BaseNode[Any], interval: float = 0.5) -> None:
        self.root, self.interval = root, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="neatpack-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval)
        self._thread = None

    def _run(self) -> None:
        from torchdata.nodes.exception_wrapper import StartupExceptionWrapper

        reported: set[int] = set()
        stop = self._stop
        while not stop.wait(self.interval):
            for it in mapper_iters(self.root):
                if it._stop.is_set():
                    continue
                for worker in list(it._workers):
                    code = getattr(worker, "exitcode", None)
                    if code in (None, 0) or worker.pid in reported:
                        continue
                    reported.add(worker.pid)
                    error = RuntimeError(
                        f"neatpack: worker process {worker.pid} of ParallelMapper died with "
                        f"{_describe(code)} while building packs. The loader cannot continue "
                        "this epoch; restart from the last checkpoint (loader.load_state_dict). "
                        "If memory ran out, lower num_workers, the pack size or max_pixels."
                    )
                    try:
                        raise error
                    except RuntimeError:
                        wrapped = StartupExceptionWrapper(where="in a neatpack worker process")  # type: ignore[no-untyped-call]
                    it._out_q.put((wrapped, -1))


_previous_unraisablehook: Any = None


def _filter_child_gc_noise(unraisable: Any) -> None:
    exc, obj = unraisable.exc_value, unraisable.object
    owner = getattr(obj, "__qualname__", "") or type(obj).__qualname__
    if (
        isinstance(exc, AssertionError)
        and "can only test a child process" in str(exc)
        and "_ParallelMapperIter" in str(owner)
    ):
        return  # torchdata 0.11: a forked worker garbage-collects its parent's iterator
    _previous_unraisablehook(unraisable)


def quiet_forked_iterator_gc() -> None:
    """Silence one known-harmless torchdata 0.11 message in forked workers (idempotent).

    A forked worker inherits its parent's ``_ParallelMapperIter`` objects; when it garbage
    collects one, ``__del__`` asks whether the parent's workers are alive and fails with
    ``AssertionError: can only test a child process``, printed as "Exception ignored in ...".
    The hook is inherited through fork, drops exactly that message, and passes every other
    unraisable exception to the previous hook.
    """
    global _previous_unraisablehook
    if _previous_unraisablehook is None:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _filter_child_gc_noise
