"""What the serve tests' drivers share (run_serve_test.py: one node; run_serve_multinode.py:
two): the tiny model's image geometry, the requests (PNG images, streamed chat completions),
the vLLM arguments, a process group that is always killed whole, the token comparison between
configurations and the printed checks.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

#: Qwen2-VL's patch (14 x 14 pixels, 3 channels, temporal patch 2) as vLLM sends it: uint8.
BYTES_PER_PATCH = 3 * 2 * 14 * 14


PATCH = 14


MERGE = 2


SERVED_NAME = "tiny-qwen2vl"


ARENA_LINE = "uses the C++ shm tensor arena"
#: Each worker's line when its response queue is ours (vllm_plugin.py).
RESPONSE_QUEUE_LINE = "response queue is this package's ring"


MISMATCH_LINE = "changed between write and release"


#: Requests per configuration: (kind, image side in pixels). The warm-up (first) is timed
#: apart: the first image request on a fresh server pays one-off start costs (seconds here).
#: "large": pixel_values >= 8 MiB (1344 x 1344 -> 96 x 96 patches = 10.8 MB); "typical":
#: ~1024 x 1024 (resized to 1036 x 1036 -> 74 x 74 patches = 6.4 MB).
IMAGE_KINDS = {"large": 1344, "typical": 1024}


@dataclass
class ImageRequest:
    """One image request and what came back."""

    kind: str
    index: int
    side: int
    seed: int
    warmup: bool
    resized: tuple[int, int] = (0, 0)
    patches: int = 0
    pixel_values_bytes: int = 0
    png_bytes: int = 0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    arena_hits: int | None = None
    arena_bytes: int | None = None
    #: Tensors the engine core sent on by reference (frontend arena), this request's share.
    arena_forwarded: int | None = None
    #: Images in the request (``seed``, ``seed + 1``, ...; all of ``side``) and choices (n).
    images: int = 1
    n: int = 1

    @property
    def key(self) -> str:
        """The request's name, the same in every configuration."""
        return f"{self.kind}-{self.index}" + ("-warmup" if self.warmup else "")


class CheckFailed(Exception):
    """A check of the end property failed (reported, the run goes on to the next check)."""


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule (transformers' ``smart_resize``, factor 28), used to know each
    image's pixel_values size before sending it."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as sr

    return sr(height, width, factor=PATCH * MERGE, min_pixels=min_pixels, max_pixels=max_pixels)


def make_png(side: int, seed: int) -> bytes:
    """A side x side RGB PNG: random 16-pixel blocks (cheap to encode, different per seed)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    n = side // 16 + 1
    blocks = rng.integers(0, 256, (n, n, 3), dtype=np.uint8)
    a = blocks.repeat(16, axis=0).repeat(16, axis=1)[:side, :side]
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(a)).save(buf, format="PNG")
    return buf.getvalue()


def post_json(url: str, body: dict, timeout: float):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=timeout)


def chat_body(content: list, seed: int, max_tokens: int, n: int = 1) -> dict:
    """The streaming chat completion request every serve driver sends (``chat_stream``'s)."""
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "seed": seed,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # a fixed number of tokens whatever the random weights emit
        "stream": True,
        "return_token_ids": True,
        # The sampled tokens' logprobs: far more sensitive to the image bytes than the greedy
        # tokens of a random-weight model, which often agree for different images.
        "logprobs": True,
    }
    if n > 1:
        # vLLM refuses n > 1 with greedy sampling; sampling with the request's seed is as
        # deterministic (the same tokens in every configuration whose logits agree).
        body["n"], body["temperature"] = n, 1.0
    return body


def chat_stream(
    base: str,
    content: list,
    seed: int,
    max_tokens: int,
    timeout: float,
    n: int = 1,
    first_token=None,
    stop=None,
) -> dict:
    """Streams one chat completion; returns TTFT, end-to-end time, token ids and text (with
    ``n`` > 1 choices, each choice's in turn: chunks of different choices interleave).
    ``first_token``: an event set when the first token arrives (the request is running).
    ``stop``: an event; once it is set the client stops reading and goes away (vLLM aborts the
    request), and ``stopped`` in the result is True."""
    body = chat_body(content, seed, max_tokens, n)
    t0 = time.monotonic()
    ttft = None
    per_choice: dict[int, tuple[list[int], list[float], list[str]]] = {}
    deadline = t0 + timeout
    stopped = False
    with post_json(f"{base}/v1/chat/completions", body, timeout) as resp:
        for raw in resp:
            if stop is not None and stop.is_set():
                stopped = True
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"chat completion took over {timeout:.0f} s")
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                piece = (choice.get("delta") or {}).get("content") or ""
                if (ids or piece) and ttft is None:
                    ttft = time.monotonic() - t0
                    if first_token is not None:
                        first_token.set()
                token_ids, logprobs, text = per_choice.setdefault(
                    int(choice.get("index", 0)), ([], [], [])
                )
                token_ids.extend(ids)
                text.append(piece)
                lp = (choice.get("logprobs") or {}).get("content") or []
                logprobs.extend(float(e["logprob"]) for e in lp)
    e2e = time.monotonic() - t0
    choices = [per_choice[i] for i in sorted(per_choice)]
    token_ids = [t for c in choices for t in c[0]]
    logprobs = [lp for c in choices for lp in c[1]]
    text = [p for c in choices for p in c[2]]
    return {
        "ttft_s": math.nan if ttft is None else ttft,
        "e2e_s": e2e,
        "token_ids": token_ids,
        "logprobs": logprobs,
        "text": "".join(text),
        "stopped": stopped,
    }


def image_content(png: bytes, *more: bytes) -> list:
    """An OpenAI chat message content: a base64 PNG image and a question; with ``more``
    images, each after a line of text."""
    out = []
    for i, p in enumerate((png, *more)):
        if i:
            out.append({"type": "text", "text": f"And image {i + 1}:"})
        url = "data:image/png;base64," + base64.b64encode(p).decode()
        out.append({"type": "image_url", "image_url": {"url": url}})
    out.append({"type": "text", "text": "Describe the image." if not more else "Compare them."})
    return out


SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<v>\S+)$")
LABEL = re.compile(r'(?P<k>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<v>[^"]*)"')


def series(samples: dict[str, float], name: str, **labels: str) -> list[tuple[dict, float]]:
    """``name``'s samples (``name{labels}`` -> value, as read from ``/metrics``) whose labels
    include every ``labels`` item, as ``(their labels, value)``."""
    out = []
    for key, v in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = {m.group("k"): m.group("v") for m in LABEL.finditer(rest)}
        if all(have.get(k) == want for k, want in labels.items()):
            out.append((have, v))
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``series(samples, name, **labels)``, e.g. ``metric(m,
    "vllm:shm_arena_hits_total", arena="queue")``."""
    return sum(v for _, v in series(samples, name, **labels))


def read_probe(probe_dir: str) -> dict[int, dict]:
    """The serve probe's records (e2e/serve_probe, one file per process), pid -> record."""
    out = {}
    for name in os.listdir(probe_dir):
        if name.endswith(".json"):
            try:
                with open(os.path.join(probe_dir, name)) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue  # being replaced; the next read has it
            out[rec["pid"]] = rec
    return out


def model_args(shutdown_timeout: int) -> list[str]:
    """The ``vllm serve`` options both serve tests give the tiny model (flag aside)."""
    return [
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        "4096",
        "--max-num-seqs",
        "4",
        "--limit-mm-per-prompt",
        '{"image": 1, "video": 0}',
        "--seed",
        "0",
        "--shutdown-timeout",
        str(shutdown_timeout),
    ]


class ProcessGroup:
    """A process started in its own session (``proc``), logging to ``log_path``: what both
    serve drivers need to stop it and read it."""

    proc: subprocess.Popen | None
    log_path: str

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def kill(self) -> None:
        """SIGKILL to the whole process group (failure path)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def log_text(self) -> str:
        """The log so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-n:])


def compare_outputs(
    configs: list[dict[str, Any]],
    keys: list[str],
    max_tokens: int,
    repeats: dict[str, str] | None = None,
    choices: dict[str, int] | None = None,
) -> tuple[dict[str, Any], list[tuple[str, str, bool, str]]]:
    """Per request, (token ids, logprobs) in every configuration: the summary and its checks
    (identical everywhere, ``max_tokens`` each, when there are several configurations; a
    different output per image; and each request of ``repeats`` (key -> the key whose image it
    sends again) the same output as its original). ``choices``: requests of n > 1, whose output
    is that many sequences of ``max_tokens``)."""
    repeats = repeats or {}
    choices = choices or {}
    outs = [
        {r["key"]: (tuple(r["token_ids"]), tuple(r["logprobs"])) for r in c["requests"]}
        for c in configs
    ]
    differing = [
        k
        for k in keys
        if any(len(o.get(k, ((),))[0]) != max_tokens * choices.get(k, 1) for o in outs)
        or any(o.get(k) != outs[0].get(k) for o in outs)
    ]
    distinct = {c["config"]: len(set(o.values())) for c, o in zip(configs, outs, strict=True)}
    identical = {
        "total": len(keys),
        "identical": len(keys) - len(differing),
        "differing": differing,
        "distinct_outputs_per_config": distinct,
    }
    checks = []
    if len(configs) > 1:
        checks.append(
            (
                "both",
                f"identical token ids and logprobs, flag on vs off ({max_tokens} per request)",
                not differing,
                json.dumps(identical),
            )
        )
    # The comparison only detects corrupted pixel_values if the output depends on them: every
    # request carries a different image, so every output must differ.
    checks.append(
        (
            "both",
            "the outputs depend on the image (a different token/logprob sequence per image)",
            all(n == len(keys) - len(repeats) for n in distinct.values()),
            json.dumps(distinct),
        )
    )
    for key, original in repeats.items():
        checks.append(
            (
                "both",
                f"{key} (the image of {original} again) returns the same output as {original}",
                all(o.get(key) == o.get(original) for o in outs),
                "",
            )
        )
    return identical, checks


def print_checks(prefix: str, checks: list[tuple[str, str, bool, str]]) -> None:
    """One line per check: pass, or FAIL with its detail."""
    for name, check, ok, detail in checks:
        print(
            f"{prefix}: {'pass' if ok else 'FAIL'} [{name}] {check}"
            + ("" if ok else f": {detail}"),
            flush=True,
        )


def prepare(r: ImageRequest, args: argparse.Namespace) -> bytes:
    """Fills in ``r``'s resized size, patches and pixel_values bytes; returns its PNG."""
    h, w = smart_resize(r.side, r.side, args.min_pixels, args.max_pixels)
    r.resized = (h, w)
    r.patches = (h // PATCH) * (w // PATCH)
    r.pixel_values_bytes = r.patches * BYTES_PER_PATCH
    png = make_png(r.side, r.seed)
    r.png_bytes = len(png)
    return png


def add_common_arguments(ap: argparse.ArgumentParser, per_kind: int, startup_timeout: float):
    """The options both serve drivers take (``per_kind``, ``startup_timeout``: their
    defaults)."""
    ap.add_argument("--per-kind", type=int, default=per_kind, help="timed requests per image kind")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234, help="sampling seed of every request")
    ap.add_argument("--omp-bind", default="0|1", help="VLLM_CPU_OMP_THREADS_BIND (per node)")
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--startup-timeout", type=float, default=startup_timeout)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--stop-timeout", type=float, default=90)
    ap.add_argument(
        "--shutdown-timeout",
        type=int,
        default=20,
        help="vllm serve --shutdown-timeout: lets the engine and workers close",
    )
    ap.add_argument("--settle-rounds", type=int, default=8)


def plan_requests(args: argparse.Namespace, prefix: str) -> tuple[list[ImageRequest], int]:
    """Makes ``args.model`` absolute and the log directory; reads the model's pixel limits
    into ``args``; returns the requests (a warm-up, then ``args.per_kind`` per image kind)
    and the image seed (``SERVE_TEST_IMAGE_SEED`` replays it)."""
    args.model = os.path.abspath(args.model)
    os.makedirs(args.log_dir, exist_ok=True)
    with open(os.path.join(args.model, "processor_config.json")) as f:
        size = json.load(f)["image_processor"]["size"]
    args.min_pixels, args.max_pixels = size["shortest_edge"], size["longest_edge"]
    seed_base = int(os.environ.get("SERVE_TEST_IMAGE_SEED", "20261201"))
    print(f"{prefix}: image seed {seed_base} (SERVE_TEST_IMAGE_SEED replays it)", flush=True)
    plan = [ImageRequest("typical", 0, IMAGE_KINDS["typical"], seed_base, warmup=True)]
    for kind, side in IMAGE_KINDS.items():
        for i in range(args.per_kind):
            plan.append(ImageRequest(kind, i, side, seed_base + 1 + len(plan), warmup=False))
    return plan, seed_base
