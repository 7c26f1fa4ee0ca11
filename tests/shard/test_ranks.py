"""The DiT sharded over a rank group on loopback (ring backend, each rank its own process):

- steps over 2 (and, marked heavy, 3) ranks equal the one-process step (relative L2 <= 1e-5 in
  float32) in pipeline and tensor mode, on a prefix-cache miss and hit, under a LoRA table,
  quantized at load, stored quantized and from a GGUF file (its encoder and VAE at the model's
  encoder_vae_dtype), and a guided sampling through the step routes equals one process's; a
  DiT file that a rank does not reach is refused naming the rank and the file;
- `gmlx serve` over 2 ranks reports the group in capabilities and status, answers steps equal
  to one process, and a rank that stops or dies turns into a 503 naming it within the bound: a
  stopped rank that resumes is taken back, a dead one leaves the group refusing model work;
- `gmlx image sample --via-steps` over 2 ranks writes the one-process image (heavy);
- Z-Image, whose pipeline runs over its three block stacks, Krea 2, FLUX.3 klein and MOSS-Image
  step as one process over 2 ranks in both modes (Z-Image, heavy, over 3 in pipeline mode;
  tensor mode over 3 is refused naming the weight that does not split).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from gmlx_contract.client import StepClient
from gmlx_contract.errors import StepError
from gmlx_contract.hashing import tensor_hash
from gmlx_server.distributed import BROKEN_END_S, HEARTBEAT_S, POLL_S, SILENT_S

from tests.compare import rel_l2
from tests.shard.folder import build_krea2_folder, build_shard_folder, build_z_image_folder

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
# A lost rank is answered within its silence limit, the watchdog's look and the HTTP poll.
LOSS_BOUND_S = SILENT_S + 2 * HEARTBEAT_S + 2 * POLL_S + 2.0
CTRL_C_BOUND_S = 10.0  # a group told to stop ends within this (it stops in well under 1 s)
# a group that lost a rank ends within this: the loss named, the answers under way given
END_BOUND_S = SILENT_S + BROKEN_END_S + 5.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_shard_folder(tmp_path_factory.mktemp("shard") / "tiny-shard")


def free_port_range(count: int) -> int:
    """A first port with `count` free loopback ports from it (and the one before, for the
    heartbeats)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1] - 1
        if (
            first > 1024
            and first + count < 65535
            and all(_free(p) for p in range(first - 1, first + count))
        ):
            return first
    raise RuntimeError("no free port range on loopback")


def _free(port: int) -> bool:
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            tcp.bind(("127.0.0.1", port))
            udp.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch_line(ranks: int, command: list[str]) -> list[str]:
    """The mlx.launch command running `command` (after `python`) on `ranks` loopback ranks."""
    args = [*LAUNCH, "-n", str(ranks), "--backend", "ring"]
    return args + ["--starting-port", str(free_port_range(ranks)), "--", sys.executable, *command]


def launch(ranks: int, command: list[str], **options) -> subprocess.Popen:
    """`command` (after `python`) on `ranks` loopback ranks, in a session of its own."""
    line = launch_line(ranks, command)
    return subprocess.Popen(line, cwd=ROOT, start_new_session=True, text=True, **options)


class _Session:
    """A tmux session standing in for the launcher's Popen: its pane's process group."""

    def __init__(self, name: str):
        self.name = name
        deadline = time.monotonic() + 30
        while True:
            listed = subprocess.run(
                ["tmux", "list-panes", "-t", name, "-F", "#{pane_pid}"],
                capture_output=True,
                text=True,
            )
            if listed.returncode == 0 and listed.stdout.strip():
                self.pid = os.getpgid(int(listed.stdout.split()[0]))
                return
            assert time.monotonic() < deadline, "tmux did not start"
            time.sleep(0.1)

    def poll(self):
        alive = subprocess.run(["tmux", "has-session", "-t", self.name], capture_output=True)
        return None if alive.returncode == 0 else 0

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("tmux", timeout)
            time.sleep(0.1)
        return 0

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def stop(process: subprocess.Popen) -> None:
    """Stop the launcher and its ranks as Ctrl-C does."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


@pytest.fixture(scope="module")
def z_image_folder(tmp_path_factory) -> Path:
    return build_z_image_folder(tmp_path_factory.mktemp("shard") / "tiny-z-image")


def start_ranks(
    ranks: int, command: list[str], scratch: Path, **rank0_options
) -> list[subprocess.Popen]:
    """`command` (after `python`) as `ranks` ring ranks on loopback, started the way mlx.launch
    starts them (MLX_RANK and a hostfile in MLX_HOSTFILE, written under `scratch`); rank 0's
    output as `rank0_options` say, the others' dropped.

    The parity checks start their ranks directly because mlx.launch 0.32 watches its ranks'
    pipes with a `select` on their always-writable input, which spins: its launcher held a core
    for the whole check, on two cores as much as the ranks themselves. The served group below
    keeps mlx.launch, whose way of ending a group with a lost rank it tests."""
    first = free_port_range(ranks)
    hostfile = scratch / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first + rank}"] for rank in range(ranks)]))
    started: list[subprocess.Popen] = []
    for rank in range(ranks):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        options = rank0_options if rank == 0 else {"stdout": subprocess.DEVNULL}
        started.append(
            subprocess.Popen(
                [sys.executable, *command],
                cwd=ROOT,
                env=env,
                text=True,
                stdin=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                **options,
            )
        )
    return started


def rank_check(folder: Path, ranks: int, mode: str, check: str = "ranks_check") -> dict:
    command = ["-m", f"tests.shard.{check}", str(folder), mode]
    with tempfile.TemporaryDirectory() as scratch:
        processes = start_ranks(ranks, command, Path(scratch), stdout=subprocess.PIPE)
        try:
            out, _ = processes[0].communicate(timeout=600)
            for process in processes[1:]:
                process.wait(60)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
    lines = [line for line in out.splitlines() if line.startswith("RESULTS ")]
    assert lines, f"no results from the ranks:\n{out[-2000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])


def check_equal(results: dict, model: str, ranks: int, mode: str) -> None:
    for case, result in results.items():
        if "rel_l2" in result:
            assert result["rel_l2"] <= TOLERANCE, (case, result)
        if "prefix" in result:
            assert result["prefix"][0] == result["prefix"][1], (case, result)
    for model_id in (model, model + "-q8", model + "-stored8", model + "-gguf"):
        assert results[f"{model_id} hit"]["prefix"] == ["hit", "hit"]
        assert results[f"{model_id} off"]["prefix"] == ["off", "off"]
        weights = results[f"{model_id} weights"]
        assert len(weights["ranks"]) == ranks
        # every rank holds less than the whole model, rank 0 the encoder and VAE besides
        assert max(weights["ranks"]) < weights["single"]
    # the GGUF DiT read by every rank from the same file steps as one process with that file
    # (above); rank 0's encoder and VAE at the model's encoder_vae_dtype, its DiT as computed
    assert results[model + "-gguf dtypes"] == {"dit": "f32", "encoder": "f16", "vae": "f16"}
    missing = results["missing on rank 1"]
    assert missing["status"] == 404, missing
    assert (
        f"rank 1 of {ranks} has no file {missing['file']!r} (the model's dit)"
        in (missing["message"])
    )
    assert results["via steps"]["distributed"]["world_size"] == ranks
    assert results["via steps"]["distributed"]["mode"] == mode


# Qwen-Image's two-rank steps repeat what the cheaper groups show: pipeline mode is Z-Image's
# two-rank pipeline check and the served group's steps through the routes (the stages, the
# hand-over, the files each rank reads); tensor mode is Krea 2's and FLUX.3 klein's two-rank
# checks (tests/shard/family_check.py), whose split of grouped key/value heads is the harder
# case. Both run with -m heavy.
@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_step_as_one_process(folder, mode):
    check_equal(rank_check(folder, 2, mode), folder.name, 2, mode)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_three_ranks_step_as_one_process(folder, mode):
    check_equal(rank_check(folder, 3, mode), folder.name, 3, mode)


def build_flux3_folder(root: Path) -> Path:
    from tests.families.flux3_klein.tiny import build_tiny_folder

    return build_tiny_folder(root)


def build_moss_folder(root: Path) -> Path:
    from tests.families.moss_image.tiny import build_tiny_folder

    return build_tiny_folder(root)


# The families family_check (tests/shard/family_check.py) runs, by their tiny folder's builder.
FAMILY_FOLDERS = {
    "krea2": build_krea2_folder,
    "flux3_klein": build_flux3_folder,
    "moss_image": build_moss_folder,
}


@pytest.fixture(scope="module")
def family_folder(request, tmp_path_factory, z_image_folder) -> Path:
    """The tiny folder of the family the test names (Z-Image's the module's own)."""
    if request.param == "z_image":
        return z_image_folder
    return FAMILY_FOLDERS[request.param](tmp_path_factory.mktemp("shard") / f"tiny-{request.param}")


def heavy(*values):
    return pytest.param(*values, marks=pytest.mark.heavy)


# Each family steps over two ranks as one process in both modes; which of them run with -m heavy:
@pytest.mark.parametrize(
    ("family_folder", "mode"),
    [
        # Z-Image's pipeline over its three block stacks; its tensor mode is Krea 2's check,
        # whose split of grouped key/value heads is the harder case
        ("z_image", "pipeline"),
        heavy("z_image", "tensor"),
        # Krea 2's tensor mode splits its grouped key/value heads and leaves its text fusion
        # whole; its pipeline mode's stages are Z-Image's check's
        heavy("krea2", "pipeline"),
        ("krea2", "tensor"),
        # FLUX.3 klein's tensor mode splits its joint blocks by heads and keeps its per-mode
        # blocks whole
        heavy("flux3_klein", "pipeline"),
        ("flux3_klein", "tensor"),
        # MOSS-Image's main blocks split by heads (q, k and v one fused weight, as FLUX.3
        # klein's, whose tensor mode runs in the quick tier) with its text projection whole
        heavy("moss_image", "pipeline"),
        heavy("moss_image", "tensor"),
    ],
    indirect=["family_folder"],
)
def test_a_family_over_two_ranks_steps_as_one_process(family_folder, mode):
    results = rank_check(family_folder, 2, mode, "family_check")
    assert results["step"]["rel_l2"] <= TOLERANCE and results["lora"]["rel_l2"] <= TOLERANCE
    assert max(results["weights"]["ranks"]) < results["weights"]["single"]


@pytest.mark.heavy
def test_z_image_over_three_ranks(z_image_folder):
    # pipeline: the noise refiner on rank 0, the context refiner on rank 1, the layers on rank 2
    results = rank_check(z_image_folder, 3, "pipeline", "family_check")
    assert results["step"]["rel_l2"] <= TOLERANCE and results["lora"]["rel_l2"] <= TOLERANCE
    refused = rank_check(z_image_folder, 3, "tensor", "family_check")["load"]["refused"]
    assert "gate_up: 2 segment(s) of 256 rows cannot be split into 3 equal parts" in refused


# ---------------------------------------------------------------- gmlx serve over the group


class Served:
    """`gmlx serve` over two loopback ranks on a free port, with the tiny folder as default."""

    def __init__(self, folder: Path, tmp: Path, mode: str, terminal: bool = False):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = tmp / "config.toml"
        config.write_text(
            f'[server]\nhost = "127.0.0.1"\nport = {self.port}\n'
            f'model_dirs = ["{folder.parent}"]\ndefault_model = "{folder.name}"\n'
        )
        self.log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed in close()
        command = ["-m", "gmlx_server", "serve", "--config", str(config), "--shard", mode]
        self.session = None
        if terminal:  # in a tmux terminal of its own, the launcher its foreground job
            self.session = f"gmlx-{self.port}"
            line = " ".join(shlex.quote(word) for word in launch_line(2, command))
            line += f" > {shlex.quote(str(tmp / 'serve.log'))} 2>&1"
            subprocess.run(
                ["tmux", "new-session", "-d", "-s", self.session, "-c", str(ROOT), line],
                check=True,
            )
            self.process = _Session(self.session)
        else:
            self.process = launch(2, command, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = StepClient(self.url)
        deadline = time.monotonic() + 120
        while not self._healthy():
            assert self.process.poll() is None, (tmp / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the group did not start serving"
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return self.client.health()
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def rank_pid(self, rank: int) -> int:
        """The process of `rank`: in the launcher's session, its environment naming the rank."""
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit() or os.getpgid(int(entry.name)) != self.process.pid:
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if f"MLX_RANK={rank}".encode() in environ and b"gmlx_server" in cmdline:
                return int(entry.name)
        raise AssertionError(f"no process of rank {rank}")

    def close(self) -> None:
        self.client.close()
        stop(self.process)
        if self.session is not None:
            self.process.kill()
        self.log.close()


@pytest.fixture
def served(folder, tmp_path, request):
    group = Served(folder, tmp_path, request.param)
    yield group
    group.close()


def ended(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie not yet reaped whose every thread has
    exited. Its main thread reads as a zombie while its other threads are still exiting, and
    until the last one has, the process's files (its sockets) stay open."""
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    return all(thread_state(thread) in ("Z", "X", None) for thread in threads)


def thread_state(thread: Path) -> str | None:
    """A /proc task's state letter (None: it is gone)."""
    try:
        return (thread / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def one_step(client: StepClient, model: str, x: np.ndarray, cond: np.ndarray, run=None):
    digest = client.put_tensor(cond)
    rows = [{"cond": digest, "num_tokens": int(cond.shape[1])}]
    return client.step(x, [0.6], rows, model=model, run=run, convention="reference")


def engine_out(folder: Path, x: np.ndarray, cond: np.ndarray) -> np.ndarray:
    from gmlx_server.engine.base import StepRow
    from gmlx_server.engine.families.qwen_image21 import family

    model = family.QWEN_IMAGE21.load(folder, folder.name)
    row = StepRow(cond=cond[0], cond_key="wire:" + tensor_hash(cond))
    return model.denoise_step(x, np.array([0.6], np.float32), [row], convention="reference").out


def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 64, 4, 4)).astype(np.float32)
    cond = rng.standard_normal((1, 6, 128)).astype(np.float32)
    return x, cond


@pytest.mark.parametrize("served", ["pipeline"], indirect=True)
def test_served_group_answers_and_refuses_a_dead_rank(served, folder):
    client = served.client
    capabilities = client.capabilities()
    assert capabilities["distributed"] == {
        "world_size": 2,
        "mode": "pipeline",
        "state": "ok",
        "reason": None,
        "silent_ranks": [],
    }
    x, cond = inputs()
    run = client.begin_run(folder.name)
    answers = [one_step(client, folder.name, x, cond, run) for _ in range(2)]
    assert [a.prefix_cache for a in answers] == ["miss", "hit"]
    expected = engine_out(folder, x, cond)
    for answer in answers:
        assert rel_l2(answer.out, expected) <= TOLERANCE
    status = client.status(folder.name)["distributed"]
    assert status["world_size"] == 2 and len(status["rank_weight_bytes"]) == 2
    # an interrupt and a run's end are rank 0's, as on one process: the ended run's states go
    # on every rank, and the next step builds them anew, equal again
    assert client.interrupt(run) == 1
    with pytest.raises(StepError) as interrupted:
        one_step(client, folder.name, x, cond, run)
    assert interrupted.value.status == 409
    client.end_run(run)
    again = one_step(client, folder.name, x, cond)
    assert again.prefix_cache == "miss" and rel_l2(again.out, expected) <= TOLERANCE

    rank0 = served.rank_pid(0)
    os.kill(served.rank_pid(1), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(StepError) as refused:
        one_step(client, folder.name, x, cond)
    assert time.monotonic() - started <= LOSS_BOUND_S
    # refused 503 naming the lost rank, or no answer once rank 0 has ended with its group
    assert refused.value.status in (503, None), refused.value
    if refused.value.status == 503:
        assert re.search(r"rank 1 of 2", str(refused.value)), str(refused.value)
    # mlx.launch ends every rank once one has died: rank 0 ends too, and so does the launcher
    deadline = time.monotonic() + END_BOUND_S
    while not (ended(rank0) and served.process.poll() is not None):
        assert time.monotonic() < deadline, "rank 0 outlived its group"
        time.sleep(0.1)
    print(f"a rank killed: rank 0 and the launcher ended {time.monotonic() - started:.1f} s after")


def all_ended(pids: list[int], bound: float) -> float:
    """Seconds until every process of `pids` ended (an AssertionError past `bound`)."""
    started = time.monotonic()
    while not all(ended(pid) for pid in pids):
        assert time.monotonic() - started < bound, f"still running: {pids}"
        time.sleep(0.1)
    return time.monotonic() - started


def heartbeat_port(served) -> int:
    """Rank 0's heartbeat port: the ring's first port less one (distributed.heartbeat_address)."""
    environ = Path(f"/proc/{served.rank_pid(0)}/environ").read_bytes().split(b"\0")
    hostfile = next(v for v in environ if v.startswith(b"MLX_HOSTFILE="))
    hosts = json.loads(Path(hostfile.split(b"=", 1)[1].decode()).read_text())
    return int(hosts[0][0].rpartition(":")[2]) - 1


@pytest.mark.parametrize("served", ["pipeline"], indirect=True)
def test_sigterm_to_the_launchers_group_ends_every_rank_and_frees_its_ports(served, folder):
    """What an operator's `kill -TERM -PGID` (or a service manager's stop) does: every rank
    ends within seconds, rank 0 too, and the heartbeat port is free for the next launch."""
    x, cond = inputs()
    one_step(served.client, folder.name, x, cond)
    ranks, port = [served.rank_pid(0), served.rank_pid(1)], heartbeat_port(served)
    os.killpg(served.process.pid, signal.SIGTERM)
    print(f"SIGTERM to the group: every rank ended in {all_ended(ranks, END_BOUND_S):.1f} s")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", port))  # free again


@pytest.mark.heavy
@pytest.mark.parametrize("served", ["tensor"], indirect=True)
def test_the_launcher_killed_ends_its_ranks(served):
    """The launcher gone without a word (SIGKILL): its ranks end with it."""
    ranks = [served.rank_pid(0), served.rank_pid(1)]
    served.process.kill()
    served.process.wait(10)
    print(f"the launcher killed: every rank ended in {all_ended(ranks, END_BOUND_S):.1f} s")


@pytest.mark.heavy
def test_ctrl_c_in_a_terminal_stops_the_group(folder, tmp_path):
    """`mlx.launch ... -- gmlx serve --shard pipeline` in a terminal (tmux), then Ctrl-C."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: the check runs the group in a tmux terminal")
    served = Served(folder, tmp_path, "pipeline", terminal=True)
    try:
        ranks = [served.rank_pid(0), served.rank_pid(1)]
        subprocess.run(["tmux", "send-keys", "-t", served.session, "C-c"], check=True)
        print(
            f"Ctrl-C in the terminal: every rank ended in {all_ended(ranks, CTRL_C_BOUND_S):.1f} s"
        )
    finally:
        served.close()


def test_a_taken_heartbeat_port_is_refused_naming_its_holder():
    from gmlx_server.distributed import Heartbeats

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        with pytest.raises(OSError) as taken:
            Heartbeats(2, ("127.0.0.1", port))
    message = str(taken.value)
    assert f"127.0.0.1:{port} is taken" in message and f"pid {os.getpid()}" in message
    assert "--starting-port" in message


@pytest.mark.parametrize("served", ["tensor"], indirect=True)
def test_a_stopped_rank_is_named_then_taken_back(served, folder):
    client = served.client
    x, cond = inputs()
    expected = engine_out(folder, x, cond)
    assert rel_l2(one_step(client, folder.name, x, cond).out, expected) <= TOLERANCE
    rank1 = served.rank_pid(1)
    # stopped during a step: the step under way is answered 503 naming it within the bound
    os.kill(rank1, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StepError) as refused:
            one_step(client, folder.name, x, cond + 1)
        assert time.monotonic() - started <= LOSS_BOUND_S
        assert refused.value.status == 503
        assert "rank 1 of 2" in str(refused.value)
        assert client.capabilities()["distributed"]["silent_ranks"] == [1]
    finally:
        os.kill(rank1, signal.SIGCONT)
    # resumed: the abandoned step finishes, the rank is heard again, steps work again
    deadline = time.monotonic() + 30
    while (
        client.capabilities()["distributed"]["state"] != "ok"
        or client.capabilities()["distributed"]["silent_ranks"]
    ):
        assert time.monotonic() < deadline, client.capabilities()["distributed"]
        time.sleep(0.5)
    assert rel_l2(one_step(client, folder.name, x, cond).out, expected) <= TOLERANCE
    # Ctrl-C reaches every rank at once: rank 0 stops the others, and every process ends
    ranks = [served.rank_pid(0), rank1]
    os.killpg(served.process.pid, signal.SIGINT)
    deadline = time.monotonic() + CTRL_C_BOUND_S
    while not all(ended(pid) for pid in ranks):
        assert time.monotonic() < deadline, "a rank outlived Ctrl-C on the group"
        time.sleep(0.1)


# The served group's steps through the routes equal one process's in the quick tier; a whole
# sampling by the command launched as ranks runs with -m heavy.
@pytest.mark.heavy
def test_sample_via_steps_over_two_ranks_writes_the_one_process_image(folder, tmp_path):
    arguments = ["image", "sample", "--model", str(folder), "--prompt", "a red fox"]
    arguments += ["--width", "64", "--height", "64", "--steps", "3", "--seed", "4"]
    single = subprocess.run(
        [sys.executable, "-m", "gmlx_server", *arguments, "--out", str(tmp_path / "one.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    command = ["-m", "gmlx_server", *arguments, "--via-steps", "--out", str(tmp_path / "two.png")]
    process = launch(2, command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = process.communicate(timeout=300)
    finally:
        stop(process)
    assert (tmp_path / "two.png").is_file(), out[-3000:]
    assert "via the step routes" in out
    assert (tmp_path / "two.png").read_bytes() == (tmp_path / "one.png").read_bytes()
