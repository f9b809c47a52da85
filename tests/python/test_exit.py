"""Exit with a daemon thread inside a GIL-released call of the extension (csrc/bindings/gil.h).

CPython ends a daemon thread that takes the GIL back once finalization has begun (3.11-3.13:
``pthread_exit`` from ``PyEval_RestoreThread``, a forced unwind that aborts the process if it
meets a ``noexcept`` frame, such as a destructor that re-takes the GIL). Every such call must
let the process exit with status 0, whichever way the thread meets finalization:

* ``late``: the thread's call returns after finalization began (it must not take the GIL);
* ``waiting``: the call returned just before, and the thread is waiting for the GIL when
  finalization begins (CPython ends it inside ``PyEval_RestoreThread``; the unwind must pass).

Each case runs in one fresh interpreter that forks ``REPEAT`` children: a child starts the
thread, waits on an Event until the thread is in its loop of calls (or, for the ring, about to
block in ``read``), and falls off the end of the script. A slow finalizer (an object whose
``__del__`` runs when finalization removes its module, so after finalization has begun) keeps
the window open long enough for the thread's call to come back.
"""

from __future__ import annotations

import json

import pytest

REPEAT = 20

_SCRIPT = r"""
import gc, json, os, random, signal, sys, tempfile, threading, time, types

import torch
from vllm_shm_arena._ext import _C

SCENARIO, TIMING, REPEAT, SEED = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
BASE = tempfile.mkdtemp(prefix="exit-", dir=os.environ["VLLM_SHM_ARENA_SHM_DIR"])


class SlowFinal:
    # Runs during finalization (see keep_until_finalization): keeps the interpreter
    # finalizing, with the GIL free, while the thread's call comes back.
    def __init__(self, wake=None, nogil_call=None):
        self.wake, self.nogil_call = wake, nogil_call

    def __del__(self, sleep=time.sleep, write=os.write):
        if self.nogil_call is not None:
            self.nogil_call()  # a GIL-released call from the finalizing thread itself
            write(1, b"finalizer-call-returned\n")
        if self.wake is not None:
            self.wake()
        sleep(0.1)
        write(1, b"finalizer-done\n")


def keep_until_finalization(obj):
    # In a module of its own, which finalization removes after it has begun. Not in this
    # script's globals: the thread's frames keep those alive past the end.
    mod = types.ModuleType("_exit_test_final")
    mod.obj = obj
    sys.modules[mod.__name__] = mod


def child(i):
    rng = random.Random(SEED * 1000 + i)
    d = tempfile.mkdtemp(dir=BASE)
    inside = threading.Event()
    wake = nogil_call = None
    if SCENARIO == "write_tensor":
        w = _C.TensorArenaWriter(1, 2, 8 << 20, d, 0, 1024)
        t = torch.ones(2 << 20)  # 8 MiB

        def loop():
            while True:
                s = w.write_tensor(t)
                if s is not None:
                    w.abort(*s)
                inside.set()
    elif SCENARIO == "ring_read":
        rw = _C.MessageRingWriter(1, 4, 1 << 20, d)
        rr = _C.MessageRingReader(rw.name, 0, d)

        def loop():
            while True:
                inside.set()
                rr.read(5.0)  # nobody writes: blocks until the ring is shut down

        wake = rw.shutdown
    elif SCENARIO == "flush_releases":
        w = _C.TensorArenaWriter(1, 2, 1 << 20, d, 0, 1024)
        r = _C.TensorArenaReader(w.name, 0, d, 0, None)

        def loop():
            while True:
                r.flush_releases(0)
                inside.set()
    elif SCENARIO == "parallel_copy":
        src, dst = torch.ones(2 << 20), torch.empty(2 << 20)

        def loop():
            while True:
                _C.parallel_copy(dst, src, True)
                inside.set()
    elif SCENARIO == "finalizer_call":
        # No thread: the finalizing thread itself makes GIL-released calls (it must not be
        # treated as a thread to stop).
        src, dst = torch.ones(1 << 20), torch.empty(1 << 20)
        rw = _C.MessageRingWriter(1, 4, 1 << 20, d)
        rr = _C.MessageRingReader(rw.name, 0, d)

        def nogil_call():
            _C.parallel_copy(dst, src, True)
            rw.write([b"x" * 1000], 0, 1.0)
            assert rr.read(1.0)[0] == "ok"

        keep_until_finalization(SlowFinal(nogil_call=nogil_call))
        return
    else:
        raise SystemExit(f"unknown scenario {SCENARIO}")
    if TIMING == "waiting":
        # The thread waits for the GIL without asking for it (for longer than finalization
        # takes to begin): the main thread lets go of it only in the slow finalizer.
        sys.setswitchinterval(0.5)
    threading.Thread(target=loop, daemon=True).start()
    assert inside.wait(60), "the thread never started its calls"
    if SCENARIO == "ring_read":
        deadline = time.monotonic() + 60
        while _C.nogil_gate_inside() == 0:  # until the thread is blocked in read, GIL free
            assert time.monotonic() < deadline, "the thread never blocked in its read"
            time.sleep(0.001)
    elif TIMING == "late":
        time.sleep(rng.random() * 0.01)
    if TIMING == "waiting" and wake is not None:
        wake()  # the read returns now; its thread then waits for the GIL this thread holds
        wake = None
    keep_until_finalization(SlowFinal(wake=wake))


gc.freeze()  # the children need not collect what they inherit: their exits are what is tested
results = []
for i in range(REPEAT):
    out = os.path.join(BASE, f"out{i}")
    pid = os.fork()
    if pid == 0:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        child(i)
        break  # the child falls off the end of the script: a normal interpreter exit
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            code = "hung"
            break
        time.sleep(0.02)
    with open(out) as f:
        results.append({"i": i, "code": code, "output": f.read()[-2000:]})
else:
    import shutil

    shutil.rmtree(BASE, ignore_errors=True)
    print("RESULTS " + json.dumps(results))
"""


def _run(run_py, seed, scenario, timing):
    print(f"VSA_SEED={seed} scenario={scenario} timing={timing} repeat={REPEAT}")
    # The script takes its arguments from sys.argv: run it as a file-less -c program.
    code = f"import sys; sys.argv[1:] = {[scenario, timing, str(REPEAT), str(seed)]!r}\n" + _SCRIPT
    rc, out, err = run_py(code, timeout=600)
    assert rc == 0, f"driver failed rc={rc}\n{out[-3000:]}\n{err[-3000:]}"
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS ") :])
    bad = [r for r in results if r["code"] != 0 or "terminate called" in r["output"]]
    return results, bad


@pytest.mark.parametrize("timing", ["late", "waiting"])
@pytest.mark.parametrize(
    "scenario", ["write_tensor", "ring_read", "flush_releases", "parallel_copy"]
)
def test_exit_with_a_daemon_thread_inside_a_gil_released_call(run_py, seed, scenario, timing):
    results, bad = _run(run_py, seed, scenario, timing)
    assert not bad, f"{len(bad)}/{len(results)} exits failed (VSA_SEED={seed}): " + "; ".join(
        f"#{r['i']} code={r['code']} {r['output'][-300:]!r}" for r in bad[:5]
    )
    assert all("finalizer-done" in r["output"] for r in results)


def test_the_finalizing_thread_itself_may_make_gil_released_calls(run_py, seed):
    results, bad = _run(run_py, seed, "finalizer_call", "late")
    assert not bad, [(r["code"], r["output"][-300:]) for r in bad[:5]]
    assert all("finalizer-call-returned" in r["output"] for r in results)
