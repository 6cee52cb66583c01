import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_tool(*args, timeout=600, check=True, **kw):
    """Run a repo script with the venv's python; returns CompletedProcess (text)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def kill_job(proc, marker: str, timeout: float = 30.0) -> None:
    """SIGKILL a torchrun job: its launcher's process group and every worker whose command line holds `marker` (torch
    elastic starts each worker in a session of its own, so killing the launcher's group leaves them running, still
    writing checkpoints), then wait until none is left."""
    import signal
    import time

    def workers() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker.encode() in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    pass
        return found

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.time() + timeout
    while (left := workers()) and time.time() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    proc.wait(timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def smol_dir():
    """SmolLM2-135M-Instruct converted to a HF folder (once per machine; ~40 s the first time)."""
    from dstrain.targets import smollm2

    return smollm2.dense_folder()


@pytest.fixture(scope="session")
def smol_tok():
    """SmolLM2's tokenizer and chat template, read from the GGUF's metadata: no weights converted (the converted
    folder's tokenizer is this same object saved), so tests marked neither slow nor distributed need no real target."""
    from transformers import AutoTokenizer

    from dstrain.targets import smollm2

    return AutoTokenizer.from_pretrained(smollm2.gguf_dir(), gguf_file=smollm2.GGUF_FILE)


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory, smol_tok):
    """A tiny random Llama with SmolLM2's tokenizer and chat template: fast generation for pipeline tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_lm")
    tok = smol_tok
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---- make test-fast needs no real target -------------------------------------------------------------------
REAL_TARGET_FIXTURES = {"smol_dir", "default_target"}  # convert / upcycle the real SmolLM2 weights


def pytest_collection_modifyitems(config, items):
    """A test that reaches the real SmolLM2 target through a fixture must be marked slow (make test-fast deselects
    slow and promises no real target); found at collection, so the whole suite is checked without running it."""
    unmarked = [item.nodeid for item in items if REAL_TARGET_FIXTURES & set(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("tests using the real SmolLM2 target (fixtures "
                                f"{sorted(REAL_TARGET_FIXTURES)}) must be marked slow: {unmarked[:5]}")


# ---- CI: a skip is a failure -------------------------------------------------------------------------------
# With CI set (any non-empty value but 0/false/no), every test must run: a skip (pytest.skip, skipif, importorskip,
# a skipped module) is reported as a failure naming its reason, so a missing dependency (Slurm, speculators, a mount)
# cannot let CI pass silently. Deselection (-m, -k) is not a skip. xfail is untouched.
def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _failed_skip(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI (CI={os.environ.get('CI')}), which must run every test: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _ci() and report.skipped and not hasattr(report, "wasxfail"):
        _failed_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _ci() and report.skipped:
        _failed_skip(report)
