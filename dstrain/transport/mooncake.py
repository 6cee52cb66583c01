"""Mooncake Store carries samples: a producer (an engine replica's connector, a target rank) puts each sample's parts and
then its manifest; the drafter rank that owns the sample polls for the manifest, reads the parts, checks them and
removes them after the step that consumed them. Keys, never tensors, travel through dstrain's own channel.

Mooncake fails by return value, not by exception; every call here turns its code into one line naming the sample and
the fix (measured on 0.3.13.post1: a missing key reads as b'', a put to an existing key returns 0 and keeps the first
value, a part larger than the client's local buffer -600, a remove inside the 10 s lease -706 unless forced, every call
-900 after ~4 s once the master is gone). On a host without RDMA it runs over TCP, bound to loopback here
(MC_TCP_BIND_ADDRESS, MC_FORCE_TCP) and with the P2P handshake, so nothing listens on a public address.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dstrain.errors import UserError
from dstrain.transport.processes import die_with_parent
from dstrain.transport.samples import MANIFEST, decode, encode, parse_manifest, part_key, run_prefix

MOONCAKE_VERSION = "0.3.13.post1"  # mooncake-transfer-engine-non-cuda (requirements.lock); its CUDA build on GPU hosts
LOOPBACK = "127.0.0.1"
NOT_INSTALLED = (f"Mooncake is not installed: `make mooncake` (Debian's libibverbs1 and mooncake-transfer-engine-non-cuda=="
                 f"{MOONCAKE_VERSION}; the CUDA wheel mooncake-transfer-engine on GPU hosts)")
CODES = {-600: "larger than the client's local buffer", -706: "inside its lease", -900: "the master does not answer"}


def loopback_only() -> None:
    """Mooncake's TCP transport on 127.0.0.1 only (set before the first client or master of this process)."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    os.environ.setdefault("MC_FORCE_TCP", "1")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


EVICTION_SHARE = 0.9  # the master evicts unread objects once a segment is this full
FILL_SHARE = 0.8  # what a run plans to keep in flight, below it
MIN_SEGMENT_MIB, MIN_BUFFER_MIB, CLIENT_SEGMENT_MIB = 512, 256, 64


def store_sizes(in_flight_bytes: int, part_bytes: int, available_bytes: int) -> tuple[int, int]:
    """(the engine's segment, each client's local buffer) in MiB for a run that keeps `in_flight_bytes` in the store
    and gets parts of up to `part_bytes`: the bytes in flight stay under the eviction threshold with a margin, and a
    part fits the buffer it is read through (-600 otherwise). Refused in one line before anything starts when this
    host cannot hold them."""
    segment = max(MIN_SEGMENT_MIB, -(-int(in_flight_bytes / FILL_SHARE) >> 20))
    buffer = max(MIN_BUFFER_MIB, -(-int(part_bytes * 1.05) >> 20))
    need = (segment + CLIENT_SEGMENT_MIB + 2 * buffer) << 20  # the engine's segment and buffer, the client's
    if need > available_bytes:
        raise UserError(f"Mooncake Store: {in_flight_bytes / 2**20:.0f} MiB of features in flight need a {segment} MiB "
                        f"segment and {buffer} MiB buffers ({need / 2**30:.1f} GiB in all) but this host has "
                        f"{available_bytes / 2**30:.1f} GiB available: lower train.micro_batch_size or data.max_length")
    return segment, buffer


def available_memory() -> int:
    """MemAvailable of /proc/meminfo (the kernel's estimate of what can be allocated without swapping)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class MooncakeMaster:
    """The store's master for a run on one host (and the tests): `mooncake_master` on 127.0.0.1, stopped with us."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 30.0):
        binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
        if not Path(binary).is_file():
            raise UserError(NOT_INSTALLED)
        loopback_only()
        self.port = port or _free_port()
        self.address = f"{LOOPBACK}:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="dstrain-mooncake-master-", suffix=".log", delete=False)
        # its HTTP metrics server binds 0.0.0.0:9003 unless told: loopback, and a port of its own per master
        self.proc = subprocess.Popen([binary, f"-rpc_address={LOOPBACK}", f"-rpc_port={self.port}",
                                      f"-metrics_host={LOOPBACK}", f"-metrics_port={_free_port()}"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy(),
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                socket.create_connection((LOOPBACK, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        self.stop()
        raise UserError(f"the Mooncake master did not start on {self.address} within {start_timeout_s:g} s: {tail[0]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class SampleStore:
    """One client of the store: put a sample (parts, then its manifest), get one (waits for its manifest, checks every
    part), remove one, clean a run's keys."""

    def __init__(self, master: str, segment_mib: int = 256, buffer_mib: int = 64, host: str = LOOPBACK,
                 protocol: str = "tcp"):
        if host == LOOPBACK:
            loopback_only()
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise UserError(NOT_INSTALLED) from None
        self.master, self.buffer_bytes = master, buffer_mib << 20
        self.store = MooncakeDistributedStore()
        code = self.store.setup(host, "P2PHANDSHAKE", segment_mib << 20, self.buffer_bytes, protocol, "", master)
        if code != 0:
            raise UserError(f"the Mooncake master at {master} did not take this client (code {code}): start it "
                            "(mooncake_master -rpc_address=HOST -rpc_port=PORT) or point the run at the one that runs")

    def _check(self, code: int, doing: str, key: str, size: int = 0) -> None:
        if code == 0:
            return
        if code == -600:
            raise UserError(f"sample {key}: {doing} needs {size / 2**20:.1f} MiB, more than the client's local buffer of "
                            f"{self.buffer_bytes / 2**20:.0f} MiB: raise the buffer above the largest sample's part")
        if code == -900:
            raise UserError(f"the Mooncake master at {self.master} does not answer ({doing} sample {key}): restart it and "
                            "rerun; the run resumes from its last checkpoint")
        raise UserError(f"Mooncake refused {doing} sample {key} (code {code}: {CODES.get(code, 'see its log')})")

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> int:
        """Every part, then the manifest; refuses a key already holding a sample (a retry takes the next attempt).
        Returns the bytes put."""
        parts, manifest = encode(tensors)
        held = self.store.is_exist(part_key(key, MANIFEST))
        if held < 0:
            self._check(held, "checking", key)
        if held == 1:
            raise UserError(f"sample {key} is in the store already: the store keeps the first value under a key, so a "
                            "retry must put under the next attempt number")
        for name, raw in parts.items():
            self._check(self.store.put(part_key(key, name), raw), f"putting part {name} of", key, len(raw))
        self._check(self.store.put(part_key(key, MANIFEST), manifest), "putting the manifest of", key, len(manifest))
        return sum(map(len, parts.values())) + len(manifest)

    def get(self, key: str, timeout_s: float, poll_s: float = 0.05) -> dict[str, torch.Tensor]:
        """The sample's tensors once its manifest is there (polled), each part checked; one line past the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = self.store.is_exist(part_key(key, MANIFEST))
            if held < 0:
                self._check(held, "waiting for", key)
            if held == 1:
                break
            if time.monotonic() > deadline:
                raise UserError(f"sample {key} did not arrive within {timeout_s:g} s: its producer did not put it (a "
                                "stopped or overloaded engine replica); it is requested again under the next attempt")
            time.sleep(poll_s)
        manifest = parse_manifest(key, self.store.get(part_key(key, MANIFEST)))
        return decode(key, manifest, {name: self.store.get(part_key(key, name)) for name in manifest})

    def remove(self, key: str, parts: list[str]) -> None:
        """The sample's parts and manifest (forced: the step that consumed it is done, whatever the lease says)."""
        for name in [MANIFEST, *parts]:  # the manifest first: no reader takes a sample whose parts are going
            code = self.store.remove(part_key(key, name), True)
            if code not in (0, -704):  # -704: no such key (a part of a failed attempt that never arrived)
                self._check(code, f"removing part {name} of", key)

    def clean_run(self, run_id: str) -> int:
        """Every key of a run (at its start and end: a killed run's samples must not feed the next one)."""
        removed = self.store.remove_by_regex("^" + re.escape(run_prefix(run_id)), True)
        if removed < 0:
            self._check(removed, "cleaning the run of", run_prefix(run_id) + "*")
        return removed

    def close(self) -> None:
        self.store.close()
