"""Tensor-parallel runner: N ranks on torch.distributed, each on its own cores.

Two ways in, both ending in the same per-rank ``optimize()`` whose ``shard_tensor_parallel`` pass
keeps that rank's heads and MLP columns:

* ``AmxConfig(tp="env")`` under ``torchrun``: this process is one rank. The process group comes
  from the environment (gloo; oneCCL's ``ccl`` backend when ``oneccl_bindings_for_pytorch`` is
  installed); every rank calls the optimized module with the same inputs and gets the same output.
* ``AmxConfig(tp=N)`` from a plain script: optimize() starts N-1 worker processes (spawned; the
  model's tensors reach them through shared memory, not copies), and returns a :class:`TPModule`.
  Each call is broadcast to the workers and rank 0's output returned: the caller sees one module.

Each rank binds itself to its cores (``os.sched_setaffinity``) and sets torch's thread count to
match. A worker that dies or hangs makes the call fail within ``AmxConfig.tp_timeout_s`` with its
exit code and error, and closes the module. A call that fails the same way on every rank (an op's
error) is raised and leaves the module usable; arguments the model does not take, or inputs of
another dtype, are refused before any rank runs them. Between calls the workers wait without a
timeout: an idle module stays usable. Workers are daemons, stopped (and the process group left,
and the caller's cores and threads given back) when the module is closed or collected, so
nothing is left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import os
import pathlib
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from amxopt.config import AmxConfig

logger = logging.getLogger(__name__)

_READY = "amxopt/ready/{}"
_OPTIMIZED = "amxopt/optimized/{}"  # a worker's optimize() is done: the first call's timeout starts after it
# A worker's start (spawn, imports, joining the store) is not a collective: on a loaded machine it
# can take longer than a short tp_timeout_s. A worker that dies while starting is seen at once.
_START_TIMEOUT_S = 120.0
_ERROR = "amxopt/error/{}"
# Rank 0 sets _CALL of call n (or of the stop) before it broadcasts it: the workers wait for that key,
# renewing the wait each _IDLE_WAIT, where a wait inside the broadcast would end after tp_timeout_s.
_CALL = "amxopt/call/{}"
_IDLE_WAIT = datetime.timedelta(days=1)
_DONE = "amxopt/done/{}"  # the last call worker r finished, returned or raised
# Worker r has read call n's arguments ("") or could not (the error): an object a worker cannot
# unpickle (a class defined under the script's main guard) is refused before rank 0 runs the call.
_READ = "amxopt/read/{}/{}"
_UNIMPORTABLE = re.compile(r"(AttributeError|ImportError|ModuleNotFoundError): ")


# --------------------------------------------------------------------------------------------------
# Cores
# --------------------------------------------------------------------------------------------------


def _parse_cores(spec: Any) -> tuple[int, ...]:
    if isinstance(spec, int):
        return (spec,)
    if isinstance(spec, str):
        cores: list[int] = []
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
        return tuple(cores)
    return tuple(int(c) for c in spec)


def _numa_nodes(allowed: list[int]) -> list[list[int]]:
    """The allowed cores grouped by NUMA node (from /sys), nodes in order; one group without /sys."""
    nodes = []
    for path in sorted(pathlib.Path("/sys/devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cores = set(_parse_cores((path / "cpulist").read_text().strip()))
        except (OSError, ValueError):
            continue
        group = [c for c in allowed if c in cores]
        if group:
            nodes.append(group)
    covered = {c for g in nodes for c in g}
    return nodes if covered == set(allowed) else [allowed]


def cpu_plan(tp: int, cpu_bind: Any = None) -> list[tuple[int, ...]]:
    """Each rank's cores.

    ``None``: the allowed cores, ordered by NUMA node, split into ``tp`` contiguous near-equal
    parts (so ranks line up with nodes when the counts divide). A list gives each rank's cores
    (ids or ``"0-3,8"`` strings): they must exist and not overlap. ``"none"``: every rank may use
    every core. More ranks than cores is allowed (each rank gets one core, shared) with a warning.

    Raises:
        ValueError: ``tp`` < 1, a list of the wrong length, a core that is not allowed here, a core
            given to two ranks, or a rank without cores.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"amxopt: tp must be a positive int or 'env', got {tp!r}")
    allowed = sorted(os.sched_getaffinity(0))
    if cpu_bind == "none":
        return [tuple(allowed)] * tp
    if cpu_bind is not None:
        if isinstance(cpu_bind, str) or len(cpu_bind) != tp:
            raise ValueError(f"amxopt: cpu_bind needs one entry of cores per rank ({tp}), got {cpu_bind!r}")
        plan = [_parse_cores(c) for c in cpu_bind]
        owner: dict[int, int] = {}
        for rank, cores in enumerate(plan):
            if not cores:
                raise ValueError(f"amxopt: cpu_bind gives rank {rank} no cores")
            missing = sorted(set(cores) - set(allowed))
            if missing:
                raise ValueError(
                    f"amxopt: cpu_bind names cores {missing} for rank {rank}; this process may use {allowed}"
                )
            for c in cores:
                if c in owner:
                    raise ValueError(f"amxopt: cpu_bind gives core {c} to ranks {owner[c]} and {rank}")
                owner[c] = rank
        return plan
    if tp > len(allowed):
        logger.warning("amxopt: tp=%d ranks on %d cores: ranks share cores (oversubscribed)", tp, len(allowed))
        return [(allowed[r % len(allowed)],) for r in range(tp)]
    ordered = [c for node in _numa_nodes(allowed) for c in node]
    bounds = [round(r * len(ordered) / tp) for r in range(tp + 1)]
    return [tuple(ordered[bounds[r] : bounds[r + 1]]) for r in range(tp)]


def describe_plan(tp: int, cpu_bind: Any = None) -> str:
    """What ``amxopt info --tp N`` prints: NUMA nodes, and each rank's cores and threads."""
    allowed = sorted(os.sched_getaffinity(0))
    nodes = _numa_nodes(allowed)
    lines = [f"{len(allowed)} cores allowed, {len(nodes)} NUMA node(s): " + "; ".join(_span(n) for n in nodes)]
    for rank, cores in enumerate(cpu_plan(tp, cpu_bind)):
        lines.append(f"  rank {rank}: cores {_span(cores)} ({len(cores)} threads)")
    return "\n".join(lines)


def _span(cores) -> str:
    cores = sorted(cores)
    parts, start = [], cores[0]
    for a, b in zip(cores, cores[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(parts)


def _bind(cores: tuple[int, ...]) -> None:
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


# --------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------


def _backend() -> str:
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401 - registers the "ccl" backend

        return "ccl"
    except ImportError:
        return "gloo"


def rank_config(config: AmxConfig) -> AmxConfig:
    """This process's rank of a ``torchrun`` job (``tp="env"``): joins the process group if the
    script has not, binds the rank's cores, and returns the config the passes read."""
    if not dist.is_initialized():
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise RuntimeError(f"amxopt: AmxConfig(tp='env') runs under torchrun; {key} is not set")
        dist.init_process_group(_backend(), timeout=datetime.timedelta(seconds=config.tp_timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if config.cpu_bind != "none":
        own = sorted(os.sched_getaffinity(0))
        every = [None] * world
        dist.all_gather_object(every, (socket.gethostname(), own))
        _bind(_rank_cores(own, [cores for host, cores in every if host == socket.gethostname()], local_rank, config))
    return dataclasses.replace(config, tp=world, tp_rank=rank, tp_group=dist.group.WORLD.group_name)


def _rank_cores(own: list[int], local: list[list[int]], local_rank: int, config: AmxConfig) -> tuple[int, ...]:
    """A torchrun rank's cores, given every rank's on this host (``local``): its own where a
    launcher pinned them apart (disjoint sets: numactl, mpirun, ``torch.backends.xeon.run_cpu``),
    which the plan would split again; else its part of the plan."""
    if (
        config.cpu_bind is None
        and len(local) > 1
        and len({c for cores in local for c in cores}) == sum(map(len, local))
    ):
        return tuple(own)
    return cpu_plan(len(local), config.cpu_bind)[local_rank]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cores, model, example_inputs, config: AmxConfig) -> None:
    # Rank 0 starts and stops the workers: a terminal's Ctrl-C, which reaches the whole process
    # group, would kill an idle worker and break the module's next call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    timeout = datetime.timedelta(seconds=config.tp_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    try:
        _bind(cores)
        import amxopt

        store.set(_READY.format(rank), "1")
        dist.init_process_group(_backend(), store=store, rank=rank, world_size=world, timeout=timeout)
        rank_cfg = dataclasses.replace(config, tp=world, tp_rank=rank, tp_group=dist.group.WORLD.group_name)
        opt = amxopt.optimize(model, example_inputs, rank_cfg)
        del model
        store.set(_OPTIMIZED.format(rank), "1")
        failed = False  # the last call raised: its error stays readable until the next call starts
        for call in itertools.count(1):
            _wait_for_call(store, call)
            message = _received()
            try:
                kind, args, kwargs, rng = pickle.loads(message)
                unread = ""
            except Exception as e:  # noqa: BLE001 - rank 0 refuses the call; no rank runs it
                kind, unread = "call", f"{type(e).__name__}: {e}"[-4000:]
            if kind == "stop":
                break
            store.set(_READ.format(call, rank), unread)
            peers = [_READ.format(call, r) for r in range(1, world)]
            store.wait(peers)
            if any(store.get(k) for k in peers):  # one could not read it: rank 0 refuses it, and no rank runs it
                store.set(_DONE.format(rank), str(call))
                continue
            torch.set_rng_state(rng)  # rank 0's: a random op in forward draws the same numbers on every rank
            if failed:
                # Dropped as this call starts, not after it: rank 0 returns from the call while this
                # rank is still finishing it, and a death then is not to be told with the old error.
                store.delete_key(_ERROR.format(rank))
                failed = False
            try:
                with torch.no_grad():
                    opt(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the call's own error: rank 0 raises it; wait for the next
                if _collective_failure(e):  # out of step with the others: this rank is done
                    raise
                store.set(_ERROR.format(rank), traceback.format_exc()[-4000:])
                failed = True
            store.set(_DONE.format(rank), str(call))
        dist.destroy_process_group()
    except BaseException as e:
        try:
            store.set(_ERROR.format(rank), traceback.format_exc()[-4000:])
        except Exception:  # noqa: BLE001 - rank 0's store is gone: rank 0 left, and reports nothing more
            pass
        if _collective_failure(e):
            # Out of step with the others (rank 0 stopped mid-call: Ctrl-C, a timeout): rank 0 says
            # so, naming this rank's error from the store; no traceback of a peer's closed connection.
            sys.exit(1)
        raise


def _collective_failure(e: BaseException) -> bool:
    """A collective that failed (a timeout, a peer gone): the ranks' collectives no longer pair up.
    gloo raises plain RuntimeErrors naming its sources."""
    return isinstance(e, dist.DistError) or "/gloo/" in str(e)


def _wait_for_call(store: dist.TCPStore, call: int) -> None:
    """Until rank 0 announces ``call``, however long the module sits idle; raises where rank 0's store
    is gone."""
    while True:
        try:
            store.wait([_CALL.format(call)], _IDLE_WAIT)
            return
        except dist.DistStoreError as e:
            if "timeout" not in str(e):
                raise


def _pickled(message: tuple) -> bytes:
    """A call's message as the ranks receive it; an argument that cannot be sent is refused here,
    before any rank is told of the call."""
    try:
        return pickle.dumps(message)
    except Exception as e:  # noqa: BLE001 - pickling raises any type (a lock's TypeError, a lambda's PicklingError)
        raise TypeError(
            f"amxopt: a tensor-parallel call sends its arguments to every rank, and one of them cannot be "
            f"pickled ({type(e).__name__}: {e})"
        ) from None


def _send(store: dist.TCPStore, state: dict, message: bytes) -> int:
    """Rank 0: announce the next call (or the stop) and broadcast it; returns its number."""
    state["calls"] += 1
    call = state["calls"]
    store.set(_CALL.format(call), "")
    if call > 1:  # every worker has passed it: it took part in that call's broadcast
        store.delete_key(_CALL.format(call - 1))
    # The pickled bytes as they are (broadcast_object_list would pickle them again: a copy of the inputs).
    dist.broadcast(torch.tensor([len(message)], dtype=torch.int64), src=0)
    with warnings.catch_warnings():  # read only: rank 0 sends the buffer, nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        dist.broadcast(torch.frombuffer(message, dtype=torch.uint8), src=0)
    return call


def _received() -> memoryview:
    """A worker's side of :func:`_send`'s broadcast: the pickled message."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return data.numpy().data


class TPModule(nn.Module):
    """N tensor-parallel ranks behind one module: rank 0 runs here, N-1 workers in other processes.

    Calls take the model's arguments and return rank 0's output (every rank's is the same).
    ``close()`` stops the workers (also done when the module is garbage-collected).
    """

    def __init__(self, model: nn.Module, example_inputs: Any, config: AmxConfig) -> None:
        super().__init__()
        import amxopt

        if dist.is_initialized():
            raise RuntimeError(
                "amxopt: torch.distributed is already initialized in this process (another tp group, or a "
                "torchrun job: use AmxConfig(tp='env') there); close() the other TPModule first"
            )
        tp = config.tp
        plan = cpu_plan(tp, config.cpu_bind)
        self.tp = tp
        self._timeout_s = config.tp_timeout_s
        # The binding is the calling thread's (a Linux affinity mask and OpenMP's count are per thread):
        # close() gives it back to this thread, whichever thread closes.
        previous = (threading.get_native_id(), os.sched_getaffinity(0), torch.get_num_threads())
        # Shared with the finalizer (which must not hold the module): calls sent, and whether this
        # module's process group is the one initialized.
        # Not in step until every rank has optimized: a worker may be waiting for an autotune decision
        # of rank 0's, which a stop message would answer.
        self._state = {"calls": 0, "group": False, "in_step": False}
        # One call at a time: every rank must see the calls, and their collectives, in one order. Re-entrant:
        # a failed call closes the module while it holds it.
        self._calls = threading.RLock()
        _check_importable(model)
        port = _free_port()
        timeout = datetime.timedelta(seconds=config.tp_timeout_s)
        self._store = dist.TCPStore("127.0.0.1", port, tp, is_master=True, timeout=timeout, wait_for_workers=False)
        context = _workers_context(model)
        self._workers = [
            context.Process(
                target=_worker,
                args=(rank, tp, port, plan[rank], model, example_inputs, config),
                daemon=True,
                name=f"amxopt-tp-rank{rank}",
            )
            for rank in range(1, tp)
        ]
        self._finalizer = weakref.finalize(self, _shut_down, self._workers, self._store, self._state, previous)
        try:
            for w in self._workers:
                _start(w)
            start_s = max(config.tp_timeout_s, _START_TIMEOUT_S)
            self._wait_for(_READY, "start", start_s)
            _bind(plan[0])
            dist.init_process_group(_backend(), store=self._store, rank=0, world_size=tp, timeout=timeout)
            self._state["group"] = True
            rank_cfg = dataclasses.replace(config, tp=tp, tp_rank=0, tp_group=dist.group.WORLD.group_name)
            self.module = amxopt.optimize(model, example_inputs, rank_cfg)
            # A worker's optimize can end later than this one's (capture on fewer cores): the first
            # call's broadcast would count that against tp_timeout_s.
            self._wait_for(_OPTIMIZED, "optimize the model", start_s)
            self._state["in_step"] = True
        except Exception as e:
            if _collective_failure(e):
                # A worker that failed (its capture, say) while rank 0 waited for it in a collective
                # (autotune's decision): the worker's error is the one that says why.
                deadline = time.monotonic() + 2.0  # its exit code settles
                while time.monotonic() < deadline and all(w.exitcode is None for w in self._workers if w.pid):
                    time.sleep(0.05)
                try:
                    self._check_workers()
                except RuntimeError as worker_failed:
                    self.close()
                    raise worker_failed from e
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _wait_for(self, key: str, what: str, timeout_s: float) -> None:
        """Until every worker has set ``key``; raises where one exits first or takes over ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, self.tp))
        while waiting:
            self._check_workers()
            waiting = {r for r in waiting if not self._store.check([key.format(r)])}
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"amxopt: tp workers {sorted(waiting)} did not {what} within {timeout_s:.0f} s")
            time.sleep(0.05 if waiting else 0)

    def _check_workers(self) -> None:
        for rank, w in enumerate(self._workers, start=1):
            if w.exitcode is not None and w.exitcode != 0:
                raise RuntimeError(f"amxopt: tp rank {rank} exited with code {w.exitcode}{self._error_of(rank)}")

    def _raised_in(self, rank: int, call: int) -> bool:
        """Whether a live worker's ``call`` raised (it stores the error, then marks the call done)."""
        try:
            done = self._store.check([_DONE.format(rank)]) and int(self._store.get(_DONE.format(rank))) == call
            return done and self._store.check([_ERROR.format(rank)])
        except Exception:  # noqa: BLE001 - the store may be gone with the failure being reported
            return False

    def _error_of(self, rank: int) -> str:
        try:
            if self._store.check([_ERROR.format(rank)]):
                return ":\n" + self._store.get(_ERROR.format(rank)).decode()
            if self._store.check([_READY.format(rank)]):
                return ""  # killed, or died in a collective
        except Exception:  # noqa: BLE001 - the store may be gone with the failure being reported
            return ""
        # Not ready: it died starting up. A worker first imports the script that started it (one
        # calling optimize() outside its main guard fails there, as Python's multiprocessing says
        # on stderr), then unpickles the model.
        return (
            " before reaching amxopt's code (its traceback is on stderr): a worker first imports the main script, "
            'so a script that optimizes with tp must do so under `if __name__ == "__main__":`, and then the '
            "model, whose code must be importable from its files"
        )

    @property
    def report(self):
        return self.module.report

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Rank 0's source model's, under its own names (as an OptimizedModule's)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)  # refused: see module.py

    def profile(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "amxopt: profile runs one process's graph, and a tensor-parallel call needs every rank in step: "
            "profile the model optimized at tp=1"
        )

    def save(self, directory: str) -> Any:
        raise RuntimeError(
            f"amxopt: a tensor-parallel module holds one shard of the weights per rank (tp={self.tp}), and saving "
            "rank 0's would lose the others: save the model optimized at tp=1"
        )

    def __getattr__(self, name: str) -> Any:
        # Drop-in, as OptimizedModule: what callers read from the model (dtype, config, ...).
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    def __reduce_ex__(self, protocol: int):
        raise TypeError(
            f"amxopt: a tensor-parallel module (tp={self.tp}) runs in {self.tp} processes and cannot be pickled or "
            "copied: optimize the source model again (or a copy of it) for another one"
        )

    def __deepcopy__(self, memo: dict) -> Any:
        self.__reduce_ex__(0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._calls:  # a second thread's call waits for this one (interleaved, they broke the group)
            return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if not self._finalizer.alive:
            raise RuntimeError("amxopt: this TPModule is closed (a rank failed, or close() was called)")
        self.module.check_inputs(*args, **kwargs)  # before any rank runs the call
        message = _pickled(("call", args, kwargs, torch.get_rng_state()))
        try:
            self._check_workers()
            call = _send(self._store, self._state, message)
            unread = self._unread(call)
        except Exception as e:  # the workers may have seen the call announced and not received it
            raise self._failed(e) from e
        except BaseException:  # KeyboardInterrupt: as above, and raised as it is
            self._failed(None)
            raise
        if unread:  # no rank runs it (every worker saw it refused): still in step
            hint = ". Define the classes of the arguments at a module's top level (not under the main guard)"
            hint = hint if _UNIMPORTABLE.search(unread) else ""
            raise TypeError(
                f"amxopt: a tensor-parallel call's arguments could not be read in a worker process ({unread}); "
                f"no rank ran it{hint}"
            )
        try:
            with torch.no_grad():
                return self.module(*args, **kwargs)
        except Exception as e:
            own = not _collective_failure(e)  # rank 0's own error, not a collective's
            if own and self._finished(call):  # every rank is through: still in step
                raise
            raise self._failed(e, own=own) from e
        except BaseException:
            self._failed(None)
            raise

    def _unread(self, call: int) -> str:
        """Wait until every worker has read ``call``'s arguments; what one could not read, or ""."""
        keys = [_READ.format(call, r) for r in range(1, self.tp)]
        deadline = time.monotonic() + self._timeout_s
        while True:  # in slices: a worker that died meanwhile is told at once, with its exit code
            try:
                self._store.wait(keys, datetime.timedelta(seconds=min(1.0, self._timeout_s)))
                break
            except dist.DistStoreError:
                self._check_workers()
                if time.monotonic() > deadline:
                    raise
        said = {r: self._store.get(k).decode() for r, k in enumerate(keys, 1)}
        if call > 1:  # every worker has passed the previous call's (each read its peers' keys before this one)
            for r in range(1, self.tp):
                self._store.delete_key(_READ.format(call - 1, r))
        return "; ".join(f"rank {r}: {error}" for r, error in said.items() if error)

    def _finished(self, call: int) -> bool:
        """Whether every worker finishes ``call`` (returns or raises) within tp_timeout_s."""
        deadline = time.monotonic() + self._timeout_s
        waiting = set(range(1, self.tp))
        while waiting and time.monotonic() < deadline:
            if not all(w.is_alive() for w in self._workers):
                return False
            keys = {r: _DONE.format(r) for r in waiting}
            waiting = {r for r, k in keys.items() if not (self._store.check([k]) and int(self._store.get(k)) >= call)}
            time.sleep(0.02 if waiting else 0)
        return not waiting

    def _failed(self, e: BaseException | None, own: bool = False) -> RuntimeError:
        """Close the module after a rank failed or the ranks fell out of step (no stop message: a
        worker may be waiting in a collective of the failed call); the error that says which and how.
        ``own``: ``e`` is rank 0's own error in the call, which the workers' failures followed."""
        self._state["in_step"] = False
        time.sleep(0.2)  # let a dying worker's exit code settle
        failed = []
        for r, w in enumerate(self._workers, start=1):
            if not w.is_alive():
                failed.append(f"rank {r} exited with code {w.exitcode}{self._error_of(r)}")
            elif self._raised_in(r, self._state["calls"]):  # raised alone: the others waited in a collective
                failed.append(f"rank {r} raised in call {self._state['calls']}{self._error_of(r)}")
        self.close()
        if own:  # (the workers' errors, a collective's timeout waiting for rank 0, come after the cause)
            after = f"; the other ranks waited for it: {'; '.join(failed)}" if failed else ""
            return RuntimeError(
                f"amxopt: a tensor-parallel call failed: rank 0 raised in call {self._state['calls']}: "
                f"{type(e).__name__}: {e}{after}"
            )
        detail = "; ".join(failed) or (
            f"no rank exited: one hung past tp_timeout_s ({self._timeout_s:g} s; a call that captures a graph again, "
            "for a new shape or dtype, must finish that capture within it too) or failed in the call"
        )
        return RuntimeError(f"amxopt: a tensor-parallel call failed: {detail} ({e})")

    def close(self) -> None:
        """Stop the workers, leave the process group and give back the caller's cores and threads;
        the module cannot be called afterwards. Closing again does nothing. A call running in another
        thread ends first (the stop message sent amid its collectives broke them)."""
        with self._calls:
            self._finalizer()


def _shut_down(workers: list, store: dist.TCPStore, state: dict, previous: tuple) -> None:
    """A TPModule's close, also run when it is collected: only the process group it joined is left."""
    if state["group"]:
        state["group"] = False
        if state["in_step"] and all(w.is_alive() for w in workers):
            try:
                _send(store, state, _pickled(("stop", (), {}, None)))
            except RuntimeError:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
    _stop(workers)
    thread, cores, threads = previous
    if os.path.exists(f"/proc/self/task/{thread}"):  # ended, its id may be another process's thread now
        try:
            os.sched_setaffinity(thread, cores)
        except OSError:  # it ended since
            pass
    if threading.get_native_id() == thread:
        torch.set_num_threads(threads)


def _workers_context(model: nn.Module):
    """Workers forked from a fresh server process (multiprocessing's forkserver, started once per
    process), which imported torch, amxopt and the first model's module: each worker then starts
    without paying those imports again (about 4 s of a tiny model's 7 s optimize at tp 2). Like spawn,
    a worker is no fork of this process (its threads, OpenMP pool and locks), takes its arguments
    pickled and imports the main script."""
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    modules = ["torch", "amxopt.runtime.tp", type(model).__module__]
    # Not the main script: the server would run a script without a main guard (the workers say so).
    context.set_forkserver_preload([m for m in modules if m not in ("__main__", "__mp_main__")])
    return context


def _check_importable(model: nn.Module) -> None:
    """Refuse a model whose classes a worker cannot import: defined in a main script that is no file
    (``python -c``, a script read from stdin, a notebook cell)."""
    main = sys.modules.get("__main__")
    if _main_file(main) is not None or getattr(main, "__spec__", None) is not None:
        return
    local = sorted({type(m).__qualname__ for m in model.modules() if type(m).__module__ == "__main__"})
    if local:
        raise RuntimeError(
            f"amxopt: tp hands the model to worker processes, which import its classes; {', '.join(local)} "
            "is defined in a main program that is no file (python -c, stdin, a notebook): define it in a module "
            "and import it, or run the ranks under torchrun with AmxConfig(tp='env')"
        )


def _main_file(main: Any) -> str | None:
    file = getattr(main, "__file__", None)
    return file if isinstance(file, str) and os.path.isfile(file) else None


@contextlib.contextmanager
def _unimportable_main_hidden():
    """While starting a worker: a main program whose ``__file__`` names no file (``<stdin>``) is not
    re-imported by it, as ``python -c``'s is not (multiprocessing would run the missing path and die)."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    if file is None or _main_file(main) is not None or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = file


def _start(worker) -> None:
    """Start a worker; its arguments (the model) are pickled, their tensors travel through shared
    memory."""
    try:
        with _unimportable_main_hidden():
            worker.start()
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        if "pickle" not in str(e):
            raise
        raise RuntimeError(
            f"amxopt: tp hands the model to its worker processes by pickling it, and it cannot be pickled ({e}): "
            "a hook or attribute holding a local function or lambda (transformers installs output-recording "
            "hooks at a call with output_hidden_states=True or output_attentions=True). Remove it before "
            "amxopt.optimize, or run the ranks under torchrun with AmxConfig(tp='env'), each building its own model"
        ) from e
    except RuntimeError as e:
        if "shared memory" not in str(e) and "No space left" not in str(e):
            raise
        raise RuntimeError(
            f"amxopt: tp could not hand the model to its workers through shared memory ({e}); /dev/shm is too "
            "small for it (a container's default is 64 MB: raise it, e.g. docker run --shm-size=...), or run "
            "the ranks under torchrun with AmxConfig(tp='env'), each loading its own model"
        ) from e


def _stop(workers: list) -> None:
    for w in workers:
        if w.pid is None:  # never started
            continue
        w.join(timeout=5)
        if w.is_alive():
            w.terminate()
            w.join(timeout=5)
        if w.is_alive():
            w.kill()
