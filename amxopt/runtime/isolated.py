"""Capture in a forked child: torch.export's imports and leftovers never enter the serving process.

Why: a capture imports torch.export's machinery (networkx among it) and leaves fake tensors, a
ShapeEnv and a fragmented heap behind, which nothing frees: 35 MB of RSS after a capture of
Qwen3-VL-2B vision (tools/bench_load.py), in the very process that then serves the model, and more
with every re-capture. Here the process forks; the child exports and runs the passes, then sends the
rewritten graph back as graph_store's JSON entry, which the parent restores as it would one from
the graph cache (no stored code runs, nothing is unpickled).

    parent:  fork ── packs the weights ──────┐ (stops) ─────────────── restore(entry) ── graph
    child:         └─ shape-only packings ── export ── passes: autotune ── dump ──┘

The child works on a new thread: the parent's OpenMP pool does not exist in a forked child, and the
first parallel region of the child's main thread would wait for it forever, while a new thread
builds a pool of its own (autotune's timing runs need one). The child never computes a packing:
every packable weight carries a meta packing (shape and dtype), which ``pack_weights`` takes as it
takes any earlier packing and the entry names by its source weight. The parent packs the weights
meanwhile, on all its threads but the one core the child's trace runs on, and restoring the entry
takes those packings; a packing the graph does not read is dropped. Before its first autotune
timing the child asks the parent to stop packing, and waits until it has: a timing must not share
the cores with the packing (Wan2.1-1.3B's 36 last packings ran beside the first timing); restore
packs the rest. The two say so through two shared semaphores, not the pipe: the parent never
writes to a child that may have died (a SIGPIPE would end a process that does not ignore it), and
neither holds a lock the other could wait on forever if it died holding it.
The parent names the file the child may send tensors in, and deletes it whatever happens.

A capture export cannot make raises the child's CaptureError here. Any other failure of the child
(the graph is not expressible as an entry, an error in a pass, the child dies) runs the capture
again in this process, which raises the real error with its traceback or returns the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import multiprocessing
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

from amxopt.capture import CaptureError
from amxopt.capture.base import _first_line
from amxopt.config import AmxConfig
from amxopt.files import save_tensors
from amxopt.ops import packed
from amxopt.passes import _autotune
from amxopt.runtime import graph_store, weights
from amxopt.runtime.graph_store import GraphEntry, GraphStoreError

logger = logging.getLogger(__name__)

Run = Callable[[], GraphEntry]  # capture and rewrite


def usable(config: AmxConfig, keep_text: bool) -> bool:
    """Whether a capture with ``config`` runs in a child: on by option, never for tensor parallelism
    (process groups do not survive a fork) or the CLI's dumps (pass texts are not sent back)."""
    return config.isolate_capture and config.tp == 1 and not keep_text and hasattr(os, "fork")


def capture(run: Run, module: nn.Module, model_name: str, config: AmxConfig) -> GraphEntry:
    """``run`` in a forked child, the graph restored here on ``module`` (the exported module); in
    this process when the child does not send one back."""
    ours, theirs = multiprocessing.Pipe(duplex=False)  # the child's reply
    handshake = _Handshake.new()
    fd, tensors_file = tempfile.mkstemp(prefix="amxopt-capture-", suffix=".safetensors")
    os.close(fd)
    try:
        return _capture(run, module, model_name, config, ours, theirs, handshake, tensors_file)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tensors_file)


def _capture(
    run: Run,
    module: nn.Module,
    model_name: str,
    config: AmxConfig,
    ours: Connection,
    theirs: Connection,
    handshake: _Handshake,
    tensors_file: str,
) -> GraphEntry:
    """:func:`capture` with its pipe, handshake and the child's tensor file made."""
    # Frozen, this process's objects are never walked by the child's collections, nor their pages
    # copied (Qwen3-VL-2B vision: the child's export 2.7 to 3.7 s in 4 runs, 3.9 s unfrozen, on a
    # noisy machine). A process that froze objects of its own is left as it is.
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        pid = os.fork()
    except OSError as e:  # no memory or process slots for a child: capture here
        pid = None
        logger.info("amxopt: %s: no capture process (%s); capturing in this process", model_name, e)
    if pid != 0 and freeze:
        gc.unfreeze()
    if pid is None:
        ours.close()
        theirs.close()
        return run()
    if pid == 0:  # the child: never returns
        ours.close()
        try:
            args = (theirs, run, module, config, handshake, tensors_file)
            worker = threading.Thread(target=_child, args=args, name="amxopt-capture")
            worker.start()
            worker.join()
        finally:
            os._exit(0)
    theirs.close()
    early: list[nn.Parameter] = []  # weights packed here while the child captures
    graph, lost = None, None
    try:
        try:
            try:
                _pack_meanwhile(module, config.provider, early, lambda: ours.poll() or handshake.asked())
            finally:
                handshake.stopped.release()  # the child may time now
            reply = json.loads(ours.recv_bytes())
        except (EOFError, OSError) as e:
            reply, lost = {}, type(e).__name__
        except BaseException:  # KeyboardInterrupt: the child must not outlive the call
            os.kill(pid, signal.SIGKILL)
            raise
        finally:
            ours.close()
            ended = _reap(pid)
        if lost is not None:  # an OOM kill, a crash in native code: the exit says which
            reply["error"] = f"the capture process ended without a graph ({lost}; {ended})"
        _autotune.reload()  # the child may have stored new decisions
        if "capture_error" in reply:  # export's verdict: the same here, so it is not run twice
            raise CaptureError(reply["capture_error"])
        graph = _restore(reply, module, config) if "entry" in reply else None
        if graph is None:
            reason = reply.get("error") or ended
            logger.info(
                "amxopt: %s: capturing in a child process failed (%s); capturing in this process", model_name, reason
            )
            graph = run()
    finally:
        _forget_unread(early, graph, config.provider)
    return graph


def _reap(pid: int) -> str:
    """Wait for the child; how it ended, as the log says it."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # reaped already: SIGCHLD ignored, or a handler of the caller's waited
        return "exit status unknown"
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _pack_meanwhile(module: nn.Module, provider: str, done: list[nn.Parameter], replied: Callable[[], bool]) -> None:
    """Pack ``module``'s packable weights here while the child captures (appending each to
    ``done``), on every thread but one where no other thread could see the lowered count (below):
    the child's trace is Python on one core. Restoring the
    graph then finds them packed. Packing stops once the child has ``replied``: restore packs the
    rest on every thread, and a capture that failed early wastes no more.

    Qwen3-VL-2B vision (771 MB packed) on 2 cores: 0.9 s on one thread, hidden behind a 3 to 4 s
    capture, against 0.6 s of restore on two after it. Wan2.1-1.3B's packing outlasts export, and
    stops when the child asks to time (:class:`_Handshake`)."""
    todo = weights.unpacked(module, provider)
    if not todo:  # a re-capture, or weights packed at load: the thread pool is left as it is
        return
    # torch's thread count is the process's: a thread that ran its first parallel op while it was
    # lowered would keep the lowered count, so a process with other threads keeps its count.
    threads = torch.get_num_threads()
    lowered = threading.active_count() == 1 and threads > 1
    if lowered:
        torch.set_num_threads(threads - 1)
    try:
        for p in todo:
            if replied():
                break
            packed.remember(p, provider, weights.pack(p, provider))
            done.append(p)
    except RuntimeError as e:  # restore packs what is left, or says why it cannot
        logger.info("amxopt: packing while the capture runs stopped (%s); the rest is packed on restore", e)
    finally:
        if lowered:
            torch.set_num_threads(threads)


def _forget_unread(early: list[nn.Parameter], graph: GraphEntry | None, provider: str) -> None:
    """Drop the packings ``_pack_meanwhile`` made that ``graph`` does not read (a weight the passes
    left to ATen, or every one when there is no graph): only a read packing releases its source."""
    read = {id(t) for t in graph.captured.gm.buffers()} if graph is not None else set()
    for p in early:
        if id(packed.packed_for(p, provider)) not in read:
            packed.forget(p, provider)


def _restore(reply: dict, module: nn.Module, config: AmxConfig) -> GraphEntry | None:
    tensors = {}
    try:
        if "tensors" in reply:
            from safetensors.torch import load_file

            tensors = load_file(reply["tensors"])
        origin = "amxopt's capture in a forked child process"
        return graph_store.restore(reply["entry"], module, config.provider, tensors, origin, timed_now=True)
    except (OSError, ValueError, KeyError, GraphStoreError) as e:
        reply["error"] = f"its graph could not be restored: {e}"
        return None


@dataclasses.dataclass
class _Handshake:
    timing: Any  # released by the child before its first autotune timing
    stopped: Any  # released by the parent once it packs no more

    @classmethod
    def new(cls) -> _Handshake:
        fork = multiprocessing.get_context("fork")  # (shared by a fork, whatever start method the process set)
        return cls(timing=fork.Semaphore(0), stopped=fork.Semaphore(0))

    def asked(self) -> bool:
        """In the parent: whether the child asked to time (once)."""
        return self.timing.acquire(block=False)

    def stop_packing(self) -> None:
        """In the child: ask the parent to stop packing, and wait until it has (or is gone)."""
        parent = os.getppid()
        self.timing.release()
        while not self.stopped.acquire(timeout=0.05):
            if os.getppid() != parent:
                raise RuntimeError("the process that forked this capture is gone")


def _child(conn, run: Run, module: nn.Module, config: AmxConfig, handshake: _Handshake, path: str) -> None:
    _autotune.before_timing = handshake.stop_packing
    try:
        weights.plan_packings(module, config.provider)
        graph = run()
        entry, tensors = graph_store.dump(graph, module, for_cache=False, live=True)
        reply: dict = {"entry": entry}
        if tensors:  # into the parent's file, which the parent deletes
            save_tensors(tensors, path)
            reply["tensors"] = path
    except CaptureError as e:
        reply = {"capture_error": str(e)}
    except BaseException as e:  # noqa: BLE001 - any other failure is re-run (and raised) by the parent
        reply = {"error": f"{type(e).__name__}: {_first_line(e)}"}
    conn.send_bytes(json.dumps(reply).encode())
