"""Installing the package the way users do, into fresh environments (slow: makes venvs).

The slow tests run by ``make install-test`` (after ``make wheel``), or ``pytest -m slow
tests/python/test_install.py``; two quick checks of the build configuration always run. Each
environment is a fresh venv under ``$VSA_INSTALL_TEST_DIR`` (default ``.compat/install-test``,
wiped first) with ``torch==$VSA_INSTALL_TORCH`` (default 2.13.0, vLLM 0.33's pin) from the
index. Every install gets an empty cache of its own. Checked:

* the README's command, ``pip install <checkout>`` with pip's defaults, builds against the
  environment's torch, leaves that torch in place, downloads no torch, and the result imports
  and works (e2e/compat_smoke.py: arena write/get, a MessageQueue round trip);
* the same from an sdist (``python -m build --sdist``) and with ``--no-build-isolation``;
* ``dist/*.whl`` (``make wheel``) installs into another fresh venv with the torch it was built
  for, without touching that torch, and works;
* an environment without torch gets one message naming what to install, and no torch.

Each install's wall time and bytes downloaded (pip's ``Downloading`` lines; for uv, its cache)
are printed and written, as a Markdown table, to
``$VSA_INSTALL_TEST_DIR/install_times.md``. Nothing here asserts a time.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("VSA_INSTALL_TEST_DIR", REPO / ".compat" / "install-test"))
TORCH = os.environ.get("VSA_INSTALL_TORCH", "2.13.0")
SMOKE = REPO / "scripts" / "compat_smoke.py"
ROWS: list[str] = []


def _run(cmd, log: Path, env=None, cwd=None) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        rc = subprocess.call(
            [str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
    return rc, time.monotonic() - t0


def _downloaded_bytes(log_text: str, cache: Path) -> tuple[int, str]:
    """Bytes fetched from the network, from pip's ``Downloading x (N MB)`` lines. uv prints no
    sizes: for it, the size of its cache without our own built package (unpacked, so above
    what was downloaded)."""
    total = 0.0
    for m in re.finditer(r"Downloading \S+ \(([0-9.]+) (kB|MB|GB)\)", log_text):
        total += float(m.group(1)) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}[m.group(2)]
    if total or not cache.exists():
        return int(total), ""
    for entry in cache.iterdir():
        for root, dirs, files in os.walk(entry):
            if "vllm_shm_arena" in dirs or any(f.startswith("vllm_shm_arena") for f in files):
                dirs[:] = []
                continue
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return int(total), " (uv cache, unpacked)"


def _torch_version(py: Path) -> str:
    """The environment's torch version, or "none"."""
    res = subprocess.run(
        [str(py), "-I", "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    return res.stdout.strip() if res.returncode == 0 else "none"


def _record(path: str, seconds: float, nbytes: int, outcome: str) -> None:
    row = f"| {path} | {seconds:.0f} | {nbytes / 1e6:.1f} | {outcome} |"
    ROWS.append(row)
    print(row)


def _venv(name: str, torch_spec: str | None) -> Path:
    """A fresh venv with a current pip and ``torch_spec`` (None: no torch)."""
    d = WORK / name
    shutil.rmtree(d, ignore_errors=True)
    subprocess.check_call([sys.executable, "-m", "venv", str(d)])
    py = d / "bin" / "python"
    log = WORK / f"{name}.setup.log"
    pkgs = ["numpy", "pyzmq"] + ([torch_spec] if torch_spec else [])
    assert _run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], log)[0] == 0, log
    assert _run([py, "-m", "pip", "install", "-q", *pkgs], log)[0] == 0, log.read_text()[-3000:]
    return py


def _install(py: Path, label: str, args: list[str], tool: list[str] | None = None):
    """Runs one install with a fresh cache; returns (rc, log text)."""
    cache = WORK / f"cache-{len(ROWS)}"
    shutil.rmtree(cache, ignore_errors=True)
    log = WORK / f"install-{len(ROWS)}.log"
    log.write_text("")
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    before = _torch_version(py)
    if tool is None:
        cmd = [py, "-m", "pip", "install", "-v", "--cache-dir", cache, *args]
    else:
        cmd = [*tool, "--cache-dir", cache, *args]
    rc, secs = _run(cmd, log, env=env, cwd=WORK)
    text = log.read_text()
    after = _torch_version(py)
    nbytes, how = _downloaded_bytes(text, cache)
    outcome = ("ok" if rc == 0 else f"failed (rc {rc})") + how
    if before != after:
        outcome += f"; torch {before} became {after}"
    _record(label, secs, nbytes, outcome)
    shutil.rmtree(cache, ignore_errors=True)
    assert before == after, f"the install replaced the environment's torch ({before} -> {after})"
    return rc, text


def _smoke(py: Path) -> str:
    res = subprocess.run(
        [str(py), "-P", str(SMOKE)], capture_output=True, text=True, cwd=WORK, timeout=600
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "smoke ok" in res.stdout
    return res.stdout


def _no_torch_download(text: str) -> None:
    for line in text.splitlines():
        assert not ("Downloading" in line and "torch-" in line), line
        assert "Collecting torch" not in line, line


# ------------------------------------------------------------------ quick checks
_SETUP_PROBE = r"""
import json, runpy, sys, setuptools
seen = {}
setuptools.setup = lambda **kw: seen.update(kw)
sys.argv = ["setup.py", "--name"]
g = runpy.run_path("setup.py")
(ext,) = seen["ext_modules"]
print(json.dumps({"flags": ext.extra_compile_args["cxx"], "std": g["CXX_STANDARD"],
                  "headers": g["_header_min_standard"](), "torch": g["_cpp_extension_standard"]()}))
"""


def test_cxx_standard_is_the_one_torch_asks_for():
    """No -std of our own where cpp_extension adds one; never below the headers' minimum."""
    out = subprocess.check_output([sys.executable, "-c", _SETUP_PROBE], cwd=REPO, text=True)
    got = json.loads(out.strip().splitlines()[-1])
    std_flags = [f for f in got["flags"] if f.startswith("-std=")]
    assert got["std"] >= max(17, got["headers"]), got
    if got["torch"] is not None and got["torch"] >= got["headers"]:
        assert std_flags == [], f"-std passed although cpp_extension adds c++{got['torch']}: {got}"
        assert got["std"] == got["torch"]
    else:
        assert std_flags == [f"-std=c++{got['std']}"], got


def test_torch_is_not_a_build_requirement():
    """A torch in [build-system] requires makes pip's isolated build fetch the newest one."""
    import tomllib

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = cfg["build-system"]["requires"]
    assert not [r for r in reqs if r.split("<")[0].split(">")[0].split("=")[0].strip() == "torch"]
    assert cfg["build-system"]["build-backend"] == "vsa_build"
    assert (REPO / "_build_backend" / "vsa_build.py").exists()


# ------------------------------------------------------------------ slow: real installs
@pytest.fixture(scope="module")
def work_dir():
    """A clean work dir; the timing table is written when the module is done."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    yield
    table = [
        f"torch {TORCH}, {os.cpu_count()} CPUs, MAX_JOBS={os.environ.get('MAX_JOBS', '2')}",
        "",
        "| install path | seconds | MB downloaded | outcome |",
        "|---|---:|---:|---|",
        *ROWS,
    ]
    (WORK / "install_times.md").write_text("\n".join(table) + "\n")
    print("\n" + "\n".join(table))


@pytest.fixture(scope="module")
def torch_env(work_dir) -> Path:
    """A fresh venv holding torch==TORCH (and numpy, pyzmq) from the index."""
    return _venv("env-checkout", f"torch=={TORCH}")


def _uninstall(py: Path) -> None:
    subprocess.call([str(py), "-m", "pip", "uninstall", "-q", "-y", "vllm-shm-arena"])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_command_from_checkout(torch_env):
    rc, text = _install(torch_env, "pip install <checkout> (defaults)", [str(REPO)])
    assert rc == 0, text[-4000:]
    _no_torch_download(text)
    assert "vllm-shm-arena: building against torch" in text
    out = _smoke(torch_env)
    assert f"torch {_torch_version(torch_env)}" in out


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_no_build_isolation_from_checkout(torch_env):
    _uninstall(torch_env)
    # What --no-build-isolation needs in the environment first (a venv's setuptools is too old
    # for the license field, or missing).
    log = WORK / "nbi-deps.log"
    rc, secs = _run(
        [torch_env, "-m", "pip", "install", "-q", "setuptools>=77", "wheel", "ninja"], log
    )
    assert rc == 0, log.read_text()
    _record("  (setuptools wheel ninja for the next row)", secs, 0, "ok")
    rc, text = _install(
        torch_env,
        "pip install --no-build-isolation <checkout>",
        ["--no-build-isolation", str(REPO)],
    )
    assert rc == 0, text[-4000:]
    _smoke(torch_env)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sdist_with_pip_defaults(torch_env):
    _uninstall(torch_env)
    tools = _venv("env-tools", None)
    subprocess.check_call([str(tools), "-m", "pip", "install", "-q", "build"])
    sdist_dir = WORK / "sdist"
    log = WORK / "sdist-build.log"
    rc, secs = _run([tools, "-m", "build", "--sdist", "-o", sdist_dir, REPO], log)
    assert rc == 0, log.read_text()[-4000:]
    (sdist,) = glob.glob(str(sdist_dir / "*.tar.gz"))
    _record("  python -m build --sdist (no torch anywhere)", secs, 0, "ok")
    rc, text = _install(torch_env, "pip install <sdist> (defaults)", [sdist])
    assert rc == 0, text[-4000:]
    _no_torch_download(text)
    _smoke(torch_env)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_no_torch_gives_one_message(work_dir):
    py = _venv("env-no-torch", None)
    rc, text = _install(py, "pip install <checkout>, no torch in the env", [str(REPO)])
    assert rc != 0
    assert "no torch found in the environment being installed into" in text
    assert "pip install torch==" in text and "--no-build-isolation" in text
    assert "Traceback" not in text
    _no_torch_download(text)


def _wheel_torch(whl: str) -> str:
    with zipfile.ZipFile(whl) as z:
        info = z.read("vllm_shm_arena/_build_info.py").decode()
    ns: dict = {}
    exec(info, ns)
    return ns["TORCH_VERSION"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_wheel_into_matching_torch(work_dir):
    wheels = sorted(glob.glob(str(REPO / "dist" / "vllm_shm_arena-*.whl")))
    if not wheels:
        pytest.skip("no dist/*.whl: run `make wheel` first (make install-test does)")
    whl = wheels[-1]
    built_for = _wheel_torch(whl)
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [
            ln for ln in z.read(meta).decode().splitlines() if ln.startswith("Requires-Dist: torch")
        ]
    assert requires == ["Requires-Dist: torch"], requires
    spec = "torch==" + built_for.split("+")[0]
    py = _venv("env-wheel", spec)
    assert _torch_version(py) == built_for, "the index's torch differs from the wheel's"
    rc, text = _install(py, f"pip install {os.path.basename(whl)}", [whl])
    assert rc == 0, text[-4000:]
    _no_torch_download(text)
    _smoke(py)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_uv_pip_install_from_checkout(torch_env):
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not os.path.exists(uv):
        pytest.skip("uv is not installed (pip install uv)")
    _uninstall(torch_env)
    rc, text = _install(
        torch_env,
        "uv pip install <checkout> (defaults)",
        [str(REPO)],
        tool=[uv, "pip", "install", "-v", "--python", str(torch_env)],
    )
    _no_torch_download(text)
    if rc != 0:
        # uv builds in a venv of its own: the one message must say what to run instead.
        assert "no torch found in the environment being installed into" in text, text[-4000:]
        rc, text = _install(
            torch_env,
            "uv pip install --no-build-isolation <checkout>",
            ["--no-build-isolation", str(REPO)],
            tool=[uv, "pip", "install", "-v", "--python", str(torch_env)],
        )
        assert rc == 0, text[-4000:]
    _smoke(torch_env)
    print(json.dumps({"uv": "ok"}))
