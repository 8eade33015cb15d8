"""Many processes, same math: torchrun (gloo, CPU, 2 processes) with DDP and FSDP2 against one process.

micro 2 x accum 2 x 2 ranks must give the same logged losses, grad norms and final weights as one process
with micro 8 x accum 1 (relative <= 1e-5, float32), for SFT (packed, padded, LoRA), DPO and GRPO (replay mode). A
short last step leaves rank 1 with only a filler micro-batch (zero target tokens) and must not hang. Killing one
rank ends the run within seconds.

Every run here sets FINETUNE_DEVICE (which the CLI honours): `cpu` puts every rank and the one-process reference
on the CPU with gloo, on a CUDA machine too (two ranks cannot share one GPU under NCCL). The equality test also
runs with `cuda` (a GPU per rank, NCCL) where the machine has at least 2 GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    QUICKSTART,
    ROOT,
    TINY,
    assert_same_steps,
    eval_lines,
    final_weights,
    rel_diff,
    run_cli,
    run_process,
    run_ranks,
    teacher_dir,
    train_lines,
)

pytestmark = pytest.mark.dist


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               _cuda_count() < 2, reason="the CUDA variant needs at least 2 GPUs (one per rank)")])]


def _env(device: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "FINETUNE_DEVICE": device, **extra}

# 10 padded rows: with a global batch of 8, step 2 has 2 rows -> rank 0 one micro-batch, rank 1 a filler. 5 eval rows
# in micro-batches of 2 at steps 0, 1 and 2: rank 0 gets two, rank 1 one and a filler that counts nothing (FSDP needs
# every rank in every forward); the token-weighted eval loss must be one process's.
SHORT = [*TINY, "datasets.0.max_rows=10", "data.packing=false", "train.max_steps=null", "train.epochs=1",
         "eval_datasets.0.max_rows=5", "eval.micro_batch_size=2", "eval.at_start=true", "eval.every_steps=1"]
# A LoRA adapter (the frozen base is not trained; under FSDP it is sharded with the adapter), packed, 3 steps.
LORA = [*TINY, "train.max_steps=3", "adapter.type=lora", "train.lr=1e-2"]
# DPO, packed (rows hold varying numbers of pairs); each rank computes the reference for its share of the pairs.
DATA = ROOT / "examples" / "data"
DPO = [*TINY, "train.max_steps=3", "train.objective=dpo", f"datasets.0.path={DATA / 'quickstart_pref_train.jsonl'}",
       "datasets.0.format=preference", f"eval_datasets.0.path={DATA / 'quickstart_pref_eval.jsonl'}",
       "eval_datasets.0.format=preference", "datasets.0.max_rows=200", "eval_datasets.0.max_rows=20"]
# GRPO on replayed rollouts (examples/data/grpo_replay_multiturn.jsonl: groups of 4, most of them multi-turn, with the
# environment's tokens unlabelled), KL to the model as loaded: the advantages are computed over the whole step before
# it is dealt to the ranks, and each rank runs the reference on its share.
# The quickstart's warmup, as the other cases: at lr 1e-2 from step one, AdamW's first step moves an entry whose
# gradient is float noise by +-lr either way (measured: one o_proj entry of 1024, 1.9e-4 on that tensor).
GRPO = [*TINY, "train.max_steps=3", "train.objective=grpo", "datasets=[]", "eval_datasets=[]", "data.packing=false",
        f"grpo.replay={DATA / 'grpo_replay_multiturn.jsonl'}", "grpo.num_generations=4", "grpo.beta=0.04"]
# Distillation, padded, steps 1 and 2 on the datasets' rows and step 3 on-policy (the student's completions, the same
# on every rank: seeded by the step), with the student's own cross-entropy; {teacher}: a tiny teacher made once.
DISTILL = [*TINY, "train.max_steps=3", "train.objective=distill", "distill.teacher={teacher}", "distill.lmbda=0.5",
           "distill.max_new_tokens=6", "distill.sft_weight=0.5", "data.packing=false"]
CASES = {"packed": [*TINY, "train.max_steps=3"], "short": SHORT, "lora": LORA, "dpo": DPO, "grpo": GRPO,
         "distill": DISTILL}


def case_args(case: str, teacher: Path) -> list[str]:
    return [arg.replace("{teacher}", str(teacher)) for arg in CASES[case]]


def torchrun(*args: str, nproc: int = 2, timeout: float = 300, device: str = "cpu") -> subprocess.CompletedProcess:
    """The ranks of a run: on the CPU forked from the tests' CLI server with torchrun's environment (helpers.run_ranks),
    on CUDA under torchrun itself."""
    if device == "cpu":
        return run_ranks(nproc, *args, env={"FINETUNE_DEVICE": device}, timeout=timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "finetune", *args]
    return run_process(cmd, env=_env(device, OMP_NUM_THREADS="1"), timeout=timeout)


def single(*args: str, device: str = "cpu") -> subprocess.CompletedProcess:
    """One process: on the CPU forked from the tests' CLI server (torch imported once: ~4 s less a run), else (CUDA,
    or `--nproc`, which execs torchrun) a plain one; one thread, as the ranks and the suite's other CLI runs."""
    if device == "cpu" and "--nproc" not in args:
        return run_cli(*args, env={"FINETUNE_DEVICE": device})
    return run_process([sys.executable, "-m", "finetune", *args], env=_env(device, OMP_NUM_THREADS="1"), timeout=300)


@pytest.fixture(scope="module", params=DEVICES)
def reference(request, tmp_path_factory) -> dict[str, Path | str]:
    """One process, micro 8 x accum 1: packed 3 steps, the padded short-last-step run, LoRA, DPO, GRPO and
    distillation (on-policy steps included); `device`:
    where they ran (and where the ranks compared with them run)."""
    device = request.param
    out: dict[str, Path | str] = {"device": device}
    teacher = teacher_dir(tmp_path_factory.mktemp("teacher"))
    out["teacher"] = teacher
    for name in CASES:
        extra = case_args(name, teacher)
        run_dir = tmp_path_factory.mktemp(f"ref-{device}-{name}")
        args = ("train", str(QUICKSTART), f"output_dir={run_dir}", *extra, "train.micro_batch_size=8",
                "train.gradient_accumulation_steps=1")
        r = single(*args, device=device)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"device: {device}" in r.stdout, r.stdout[-2000:]
        out[name] = run_dir
    return out


# Final weights, relative. LoRA's B starts at 0 and AdamW's first steps move each entry by about lr * sign(g): an
# entry whose gradient is within float-summation noise of 0 can move either way, so the summation order of 2
# ranks shows in the weights more than in the loss and grad norm (1.06e-5 on an Intel Sapphire Rapids CPU).
WEIGHT_TOLERANCE = {"lora": 5e-5}


def assert_same_training(run_dir: Path, ref: Path, weight_tolerance: float = 1e-5) -> None:
    assert_same_steps(train_lines(run_dir), train_lines(ref), equal=("tokens", "seq_tokens"))
    got, want = final_weights(run_dir), final_weights(ref)
    assert set(got) == set(want)
    for name in want:
        assert rel_diff(got[name], want[name]) <= weight_tolerance, name


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(tmp_path, reference, strategy, case):
    if (strategy, case) == ("fsdp", "distill"):
        pytest.skip("on-policy distillation is refused with fsdp (distill.lmbda: recipe validation)")
    extra = case_args(case, reference["teacher"])
    args = ["train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *extra, "train.micro_batch_size=2",
            "train.gradient_accumulation_steps=2", f"distributed.strategy={strategy}"]
    device = reference["device"]
    # One case goes through `finetune train --nproc 2`, which execs torchrun itself.
    if (strategy, case) == ("ddp", "short"):
        r = single(*args, "--nproc", "2", device=device)
    else:
        r = torchrun(*args, device=device)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "world size 2" in r.stdout
    assert f"device: {device}" in r.stdout  # rank 0's log: cpu, or cuda:0
    assert_same_training(tmp_path / "run", reference[case], WEIGHT_TOLERANCE.get(case, 1e-5))
    if case == "short":
        _assert_same_evals(tmp_path / "run", reference[case])


def _assert_same_evals(run_dir: Path, ref: Path) -> None:
    got, want = eval_lines(run_dir), eval_lines(ref)
    assert [x["step"] for x in got] == [x["step"] for x in want] == [0, 1, 2]
    for a, b in zip(got, want):
        assert a["eval_tokens"] == b["eval_tokens"] > 0
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * b["eval_loss"], (a, b)


def test_fsdp_checkpoint_resumes_on_another_world_size(tmp_path):
    """An FSDP2 sharded checkpoint (torch.distributed.checkpoint) written by 2 ranks (micro 3 x accum 2) and
    resumed by 3 ranks (micro 2 x accum 2): the same global batch of 12, so the same training as one process
    with micro 12 x accum 1."""
    common = [*TINY, "train.max_steps=3", "distributed.strategy=fsdp"]
    ref = tmp_path / "ref"
    r = single("train", str(QUICKSTART), f"output_dir={ref}", *common, "train.micro_batch_size=12",
               "train.gradient_accumulation_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    r = torchrun("train", str(QUICKSTART), f"output_dir={run}", *common, "train.micro_batch_size=3",
                 "train.gradient_accumulation_steps=2", "checkpoint.every_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "checkpoints" / "step-2" / "dcp" / ".metadata").is_file()
    for name in ("final", "checkpoints/step-3"):
        subprocess.run(["rm", "-rf", str(run / name)], check=True)
    r = torchrun("train", str(QUICKSTART), f"output_dir={run}", *common, "train.micro_batch_size=2",
                 "train.gradient_accumulation_steps=2", "resume=auto", nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "world size 3" in r.stdout
    assert_same_training(run, ref)


def test_rank_0_failing_while_the_others_wait_ends_the_run_with_its_message(tmp_path):
    """Rank 0 preprocesses alone while rank 1 waits for it (for hours, by design). A bad row stops rank 0 with a
    UserError: the run must end promptly with that message, not hang in a barrier."""
    data = tmp_path / "bad.jsonl"
    rows = QUICKSTART.parent.joinpath("..", "data", "quickstart_train.jsonl").read_text().splitlines()[:20]
    data.write_text("\n".join([*rows, '{"messages": ['""]) + "\n")
    # The hang guard is the timeout: waiting in a barrier, rank 1 would wait for hours (FINETUNE_DIST_WAIT_S).
    r = torchrun("train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *TINY, "train.max_steps=2",
                 f"datasets.0.path={data}", timeout=120)
    assert r.returncode != 0
    assert "bad.jsonl:21" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


def test_nproc_refuses_an_existing_run_before_torchrun_starts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "finetune-run.json").write_text('{"run_id": "earlier", "files": ["metrics.jsonl"]}')  # an earlier run's
    r = single("train", str(QUICKSTART), f"output_dir={run}", *TINY, "--nproc", "2")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "already holds a run" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert (run / "metrics.jsonl").read_text() == "{}\n"  # nothing lost


def test_killing_one_rank_ends_the_run_quickly(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "finetune",
           "train", str(QUICKSTART), f"output_dir={tmp_path / 'run'}", *TINY, "train.max_steps=100000",
           "train.epochs=null"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env("cpu", OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        victim = _rank_pid(proc.pid, rank=1)
        os.kill(victim, signal.SIGKILL)
        # The hang guard: left to itself, rank 0 would wait in its collective for the process group's timeout.
        code = proc.wait(timeout=60)
    finally:
        # torchrun starts each worker in its own session: kill them by pid, not through torchrun's group.
        for pid in _worker_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM reaches ranks at different moments (torchrun passes its own on one worker after another), here only
    rank 1: the request rides along in the step's counts, so both ranks finish the same step, write its checkpoint
    together (a collective: ranks at different steps would hang there) and exit 143 within seconds."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "finetune",
           "train", str(QUICKSTART), f"output_dir={run}", *TINY, "train.max_steps=100000", "train.epochs=null"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env("cpu", OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.1)
        os.kill(_rank_pid(proc.pid, rank=1), signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        for pid in _worker_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    steps = [r["step"] for r in train_lines(run)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)), steps
    assert out.count(f"stopped on SIGTERM after step {last} of 100000") == 2, out[-3000:]  # both ranks
    assert "exitcode  : 143" in out, out[-3000:]
    from finetune.run import checkpoint

    assert [p.name for p in checkpoint.complete_checkpoints(run / "checkpoints")] == [f"step-{last}"]


def _worker_pids(root_pid: int) -> dict[int, int]:
    """{pid: rank} of the worker processes of the torchrun process `root_pid`."""
    workers = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        rank = [e for e in environ if e.startswith(b"RANK=")]
        if parent == root_pid and rank:
            workers[int(entry.name)] = int(rank[0][5:])
    return workers


def _rank_pid(root_pid: int, rank: int) -> int:
    """The pid of the worker process with RANK=rank under the torchrun process."""
    for pid, worker_rank in _worker_pids(root_pid).items():
        if worker_rank == rank:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under pid {root_pid}")


def _reductions(tmp_path: Path, strategy: str, micro: int, accumulation: int) -> dict[str, int]:
    """Collective calls counted by the profiler over a one-step run of 2 ranks (tests/comm_count_worker.py)."""
    run_dir = tmp_path / f"{strategy}-{micro}x{accumulation}"
    r = run_ranks(2, str(QUICKSTART), f"output_dir={run_dir}", *TINY, "train.max_steps=1",
                  f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accumulation}",
                  f"distributed.strategy={strategy}", "data.packing_check=false", env={"FINETUNE_DEVICE": "cpu"},
                  script=ROOT / "tests" / "comm_count_worker.py")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    line = next(x for x in reversed(r.stdout.splitlines()) if x.startswith("{"))
    return json.loads(line)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_accumulating_micro_batches_adds_no_gradient_communication(tmp_path, strategy):
    """One step of 8 rows on 2 ranks: as 1 micro-batch of 4 per rank or as 4 micro-batches of 1, the ranks exchange
    gradients the same number of times (once per FSDP2 shard group, once per DDP bucket): the earlier micro-batches
    accumulate locally (DDP no_sync, FSDP2 set_requires_gradient_sync(False)). Without that, FSDP2 reduce-scatters
    every layer after every micro-batch (4x here)."""
    once, split = _reductions(tmp_path, strategy, 4, 1), _reductions(tmp_path, strategy, 1, 4)
    if strategy == "fsdp":
        assert once["reduce_scatter"] > 0
        assert split["reduce_scatter"] == once["reduce_scatter"], (once, split)
    else:
        assert once["reduce_scatter"] == split["reduce_scatter"] == 0
    assert split["all_reduce"] == once["all_reduce"], (once, split)


def test_the_model_is_freed_before_the_process_group_is_shut_down(tmp_path, monkeypatch):
    """DDP's reducer holds the process group: a model freed only after shutdown() destroyed the group (when
    train() returned) hung a gloo rank now and then at exit. Here, in one process, shutdown must find the model
    (the net the step loop ran) already gone."""
    import weakref

    from finetune import dist
    from finetune.recipe import load_recipe
    from finetune.train import loop

    nets: list[weakref.ref] = []
    seen_at_shutdown: list[bool] = []
    setup, shutdown = loop.setup, dist.shutdown
    monkeypatch.setattr(loop, "setup", lambda *a, **k: (run := setup(*a, **k), nets.append(weakref.ref(run.net)))[0])
    monkeypatch.setattr(dist, "shutdown", lambda *a, **k: (seen_at_shutdown.append(nets[0]() is not None),
                                                           shutdown(*a, **k))[1])
    monkeypatch.setenv("FINETUNE_DEVICE", "cpu")
    recipe = load_recipe(QUICKSTART, [*TINY, "train.max_steps=1", f"output_dir={tmp_path / 'run'}"])
    loop.train(recipe)
    assert seen_at_shutdown == [False]


def test_shutdown_frees_reference_cycles_while_the_group_lives(tmp_path):
    """FSDP2's modules sit in reference cycles, which `del` does not free: left to a collection at interpreter exit,
    after the group was destroyed, a gloo rank aborted now and then (CI). shutdown() must collect them first."""
    import gc
    import weakref

    import torch
    import torch.distributed as torch_dist

    from finetune import dist

    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group_alive_when_freed: list[bool] = []
    gc.disable()  # no automatic collection between dropping the cycle and shutdown()
    try:
        cycle: list = []
        cycle.append(cycle)
        holder = torch.nn.Linear(2, 2)
        holder.cycle = cycle
        cycle.append(holder)
        weakref.finalize(holder, lambda: group_alive_when_freed.append(torch_dist.is_initialized()))
        del cycle, holder
        dist.shutdown()
    finally:
        gc.enable()
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
    assert group_alive_when_freed == [True]
