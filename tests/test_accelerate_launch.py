"""`accelerate launch` on a CPU-only machine: 2 ranks on gloo, FSDP2-sharded, same model as 1 rank.

The command users run (README, docs/distributed.md):

    accelerate launch --multi_gpu --num_processes 2 -m dptrain train --config configs/tiny.yaml \
        --output-dir DIR train.checkpoint_every=0 performance.sharding=fsdp

On a machine without GPUs ``--multi_gpu`` still starts torchrun with 2 ranks; they see no CUDA
and join the process group on gloo (dptrain.parallel.dist.init_from_env). ``--cpu`` must not be
added (accelerate refuses it together with --multi_gpu, and alone it starts one process).

The test runs that command in a subprocess and compares final/model.safetensors with an
in-process 1-rank run of the same config (GPT-2's tied wte/lm_head is stored once in both).
Its time is mostly interpreter start-up and imports (accelerate's launcher, then two ranks
importing torch, transformers and timm; the reference runs in this process meanwhile): 46 s on
a shared 2-core machine at load average ~5, over 90 s when the load is higher (~8).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
OVERRIDES = ["train.checkpoint_every=0", "train.progress=false", "performance.sharding=fsdp"]


def _launcher() -> list[str]:
    script = Path(sys.executable).parent / "accelerate"
    if script.exists():
        return [str(script), "launch"]
    return [sys.executable, "-m", "accelerate.commands.launch"]


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_accelerate_launch_two_cpu_ranks_equal_one(tmp_path):
    pytest.importorskip("accelerate")
    from dptrain.cli import main

    two = tmp_path / "two"
    env = dict(os.environ)
    # A user's default accelerate config (HF_HOME/accelerate/default_config.yaml) would fill in
    # values the flags leave open; an empty HF_HOME keeps the test to the flags below.
    env.update(HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    # the 2 ranks also write sharded (DCP) checkpoints at steps 2 and 4, through the CLI
    cmd = [*_launcher(), "--multi_gpu", "--num_processes", "2",
           "--main_process_port", "0",  # 0: a free port (other jobs may hold 29500)
           "-m", "dptrain", "train", "--config", TINY, "--output-dir", str(two), *OVERRIDES,
           "train.checkpoint_every=2"]
    log = open(tmp_path / "launch.log", "w+")
    # its own session: on a failure the launcher and its ranks go together (killpg)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        # the 1-rank reference, in this process, while the 2 ranks import and start
        one = tmp_path / "one"
        assert main(["train", "--config", TINY, "--output-dir", str(one), *OVERRIDES]) == 0
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.seek(0)
    text = log.read()
    assert code == 0, text[-6000:]
    assert text.count("done: 4 steps") == 1, text[-6000:]  # rank 0 speaks for the run

    s1 = json.loads((one / "summary.json").read_text())
    s2 = json.loads((two / "summary.json").read_text())
    assert s2["steps"] == s1["steps"] == 4
    assert (s1["world_size"], s2["world_size"]) == (1, 2)  # the ranks that finished the run
    assert s2["epsilon"] == pytest.approx(s1["epsilon"], rel=1e-12)
    a, b = _load(two / "final" / "model.safetensors"), _load(one / "final" / "model.safetensors")
    # both store GPT-2's tied wte/lm_head once, under transformer.wte.weight
    assert sorted(a) == sorted(b) and "transformer.wte.weight" in a
    for k in b:
        rel = float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12))
        assert rel <= 1e-5, (k, rel)
    assert s2["metrics"]["nll_per_token"] == pytest.approx(s1["metrics"]["nll_per_token"],
                                                           rel=1e-4)

    # issue 6 through the CLI: each rank wrote its own shards; the step-4 checkpoint holds the
    # final model exactly; `--resume` of the step-2 one on 1 rank ends at the same model (1e-5)
    from dptrain import checkpoint as ckpt

    names = sorted(p.name for p in (two / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000004"], names
    last = two / "checkpoints" / "step-00000004"
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= {p.name for p in last.iterdir()}
    state = ckpt.read(last)
    assert state["world_size"] == 2 and state["step"] == 4
    for k in a:
        assert torch.equal(state["model"][k], a[k]), k
    resumed = tmp_path / "resumed"
    assert main(["train", "--config", TINY, "--output-dir", str(resumed), *OVERRIDES,
                 "--resume", str(two / "checkpoints" / "step-00000002")]) == 0
    c = _load(resumed / "final" / "model.safetensors")
    for k in b:
        rel = float((c[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12))
        assert rel <= 1e-5, (k, rel)


def test_launch_files_parse_and_pass_the_per_job_values_as_flags():
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig

    for name in ("accelerate_single_node.yaml", "accelerate_multinode.yaml"):
        cfg = ClusterConfig.from_yaml_file(str(ROOT / "launch" / name))  # unknown keys raise
        assert cfg.distributed_type.value == "MULTI_GPU"  # never FSDP: dptrain shards itself
        assert cfg.num_processes == -1  # accelerate insists on --num_processes
        assert cfg.mixed_precision == "no" and not cfg.use_cpu
    multi = ClusterConfig.from_yaml_file(str(ROOT / "launch" / "accelerate_multinode.yaml"))
    assert multi.main_process_ip is None and multi.same_network
    sbatch = ROOT / "launch" / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(sbatch)], check=True)
    text = sbatch.read_text()
    for flag in ("--config_file \"$ROOT/launch/accelerate_multinode.yaml\"",
                 "--num_machines \"$NNODES\"", "--machine_rank \"$SLURM_NODEID\"",
                 "--main_process_ip \"$MASTER_ADDR\"", "--main_process_port \"$MASTER_PORT\"",
                 "--ntasks-per-node=1", "-m dptrain train"):
        assert flag in text, flag
    # so every documented command with the multi-node file passes them too (the ImageNet
    # configs' comments did not: accelerate exits, "You need to manually pass in --num_processes")
    docs = [*sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "docs").glob("*.md")),
            ROOT / "README.md"]
    for path in docs:
        joined = re.sub(r"\\\s*\n[\s#]*", " ", path.read_text())  # continuation lines
        for line in joined.splitlines():
            command = line.lstrip("#` ")
            if command.startswith("accelerate launch") and "accelerate_multinode.yaml" in command:
                for flag in ("--num_machines", "--num_processes", "--machine_rank",
                             "--main_process_ip"):
                    assert flag in command, (path.name, flag, command)


def _sbatch(tmp_path: Path, args: list[str], cwd: Path | None = None, **env_extra: str) -> tuple[int, str, list[str], list[str]]:
    """Run launch/slurm.sbatch as Slurm would on the first node, with stub ``scontrol``/``srun``
    and a stub ``$VENV/bin/accelerate`` that records its arguments. Returns (exit status,
    stderr, srun's arguments, accelerate's arguments)."""
    stubs = tmp_path / "stubs"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    stubs.mkdir(exist_ok=True)
    (stubs / "scontrol").write_text("#!/usr/bin/env bash\necho node-a\necho node-b\n")
    # srun: record its options, then run the per-node command once (as node 0)
    (stubs / "srun").write_text(
        "#!/usr/bin/env bash\n"
        "while [ \"${1#--}\" != \"$1\" ]; do echo \"$1\" >> \"$LOG_DIR/srun.args\"; shift; done\n"
        "SLURM_NODEID=0 exec \"$@\"\n")
    (venv / "bin" / "accelerate").write_text(
        "#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > \"$LOG_DIR/accelerate.args\"\n"
        "echo \"${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-unset}\" > \"$LOG_DIR/shutdown_timeout\"\n"
        "pwd > \"$LOG_DIR/cwd\"\n")
    for f in (stubs / "scontrol", stubs / "srun", venv / "bin" / "accelerate"):
        f.chmod(0o755)
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    for f in logs.iterdir():
        f.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.pop("OUTPUT_DIR", None)
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    env.update(PATH=f"{stubs}:{env['PATH']}", VENV=str(venv), LOG_DIR=str(logs),
               SLURM_JOB_NODELIST="node-[a-b]", SLURM_NNODES="2", SLURM_JOB_ID="4242",
               SLURM_SUBMIT_DIR=str(ROOT), GPUS_PER_NODE="2")
    env.update(env_extra)
    proc = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=cwd)
    read = lambda name: ((logs / name).read_text().splitlines()  # noqa: E731
                         if (logs / name).exists() else [])
    return proc.returncode, proc.stderr, read("srun.args"), read("accelerate.args")


def test_slurm_script_resumes_a_requeued_job_and_refuses_a_resume_without_its_directory(tmp_path):
    """A preempted job that Slurm requeues runs the script again (same job id, SLURM_RESTART_COUNT
    > 0): it must continue its run (--resume auto), not start a fresh one that train refuses.
    A new submission has a new job id, so the default output directory (runs/CONFIG-JOBID) would
    be a new, empty one: `--resume` without OUTPUT_DIR would silently start afresh; refused."""
    code, err, srun, acc = _sbatch(tmp_path, [TINY, "performance.sharding=fsdp"])
    assert code == 0, err
    assert acc[acc.index("--output-dir") + 1] == "runs/tiny-4242"
    assert "--resume" not in acc  # a first start: no resume
    assert acc[acc.index("--machine_rank") + 1] == "0"
    assert acc[acc.index("--num_processes") + 1] == "4"
    assert acc[acc.index("--main_process_ip") + 1] == "node-a"

    code, err, srun, acc = _sbatch(tmp_path, [TINY, "performance.sharding=fsdp"],
                                   SLURM_RESTART_COUNT="1")
    assert code == 0, err
    assert acc[acc.index("--output-dir") + 1] == "runs/tiny-4242"
    assert acc[acc.index("--resume") + 1] == "auto"
    assert "performance.sharding=fsdp" in acc

    # an explicit --resume is kept as given (not doubled)
    code, err, srun, acc = _sbatch(tmp_path, [TINY, "--resume", "auto"],
                                   SLURM_RESTART_COUNT="1", OUTPUT_DIR="runs/mine")
    assert code == 0, err
    assert acc.count("--resume") == 1 and acc[acc.index("--output-dir") + 1] == "runs/mine"

    # a job started from --resume PATH and requeued after it wrote checkpoints of its own: PATH
    # again would be refused (its later checkpoints would be overwritten); it continues them
    branch = tmp_path / "branch"
    code, err, srun, acc = _sbatch(tmp_path, [TINY, "--resume", "runs/old/checkpoints/step-4"],
                                   SLURM_RESTART_COUNT="1", OUTPUT_DIR=str(branch))
    assert code == 0 and acc[acc.index("--resume") + 1] == "runs/old/checkpoints/step-4"
    (branch / "checkpoints" / "step-00000013").mkdir(parents=True)
    for given in (["--resume", "runs/old/checkpoints/step-4"], ["--resume=runs/old/x"]):
        code, err, srun, acc = _sbatch(tmp_path, [TINY, *given, "seed=3"],
                                       SLURM_RESTART_COUNT="1", OUTPUT_DIR=str(branch))
        assert code == 0, err
        assert acc.count("--resume") == 1 and acc[acc.index("--resume") + 1] == "auto"
        assert not any("runs/old" in a for a in acc) and "seed=3" in acc
    code, err, srun, acc = _sbatch(tmp_path, [TINY, "--resume", "runs/old/checkpoints/step-4"],
                                   OUTPUT_DIR=str(branch))  # not requeued: as given
    assert acc[acc.index("--resume") + 1] == "runs/old/checkpoints/step-4"

    # a new job resuming needs the old job's directory: refused, one line, nothing launched
    code, err, srun, acc = _sbatch(tmp_path, [TINY, "--resume", "auto"])
    assert code == 2 and not acc
    assert len(err.strip().splitlines()) == 1 and "OUTPUT_DIR" in err


def test_slurm_script_gives_the_ranks_time_to_checkpoint_after_sigterm(tmp_path):
    """torchrun SIGKILLs the ranks 30 s after forwarding a SIGTERM unless
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise: the 120 s of --signal=TERM@120 were 30 s."""
    code, err, _, _ = _sbatch(tmp_path, [TINY])
    assert code == 0, err
    assert (tmp_path / "logs" / "shutdown_timeout").read_text().strip() == "100"
    code, err, _, _ = _sbatch(tmp_path, [TINY], TORCH_ELASTIC_SHUTDOWN_TIMEOUT="300")
    assert (tmp_path / "logs" / "shutdown_timeout").read_text().strip() == "300"
    assert "#SBATCH --signal=TERM@120" in (ROOT / "launch" / "slurm.sbatch").read_text()


def test_slurm_script_gives_the_per_node_task_the_allocations_cpus(tmp_path):
    """Since Slurm 22.05 srun does not take --cpus-per-task from the batch allocation: the
    per-node launcher (and every rank it starts) would be confined to one CPU."""
    code, err, srun, _ = _sbatch(tmp_path, [TINY], SLURM_CPUS_PER_TASK="32")
    assert code == 0, err
    assert "--cpus-per-task=32" in srun
    # and its environment: under sbatch --export=NONE srun inherits NONE, and the task ran
    # "/bin/accelerate" (ROOT, VENV, CONFIG ... are exported for it)
    assert "--export=ALL" in srun


def test_slurm_script_submitted_outside_the_checkout(tmp_path):
    """sbatch from another directory: SLURM_SUBMIT_DIR is not the checkout, and Slurm runs a
    spool copy of the script, so the venv and launch files would be looked up in the wrong place.
    Refused in one line naming DPTRAIN_ROOT; with DPTRAIN_ROOT set, it launches."""
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    code, err, _, acc = _sbatch(tmp_path, [TINY], SLURM_SUBMIT_DIR=str(elsewhere))
    assert code == 2 and not acc
    assert len(err.strip().splitlines()) == 1 and "DPTRAIN_ROOT" in err
    code, err, _, acc = _sbatch(tmp_path, [TINY], SLURM_SUBMIT_DIR=str(elsewhere),
                                DPTRAIN_ROOT=str(ROOT))
    assert code == 0, err
    assert acc[acc.index("--config_file") + 1].startswith(str(ROOT))
    # relative paths stay relative to the job's working directory (Slurm starts the script in
    # the submit directory), not to the checkout: the script used to cd into DPTRAIN_ROOT
    (elsewhere / "my.yaml").write_text(Path(TINY).read_text())
    code, err, _, acc = _sbatch(tmp_path, ["my.yaml"], cwd=elsewhere,
                                SLURM_SUBMIT_DIR=str(elsewhere), DPTRAIN_ROOT=str(ROOT))
    assert code == 0, err
    assert (tmp_path / "logs" / "cwd").read_text().strip() == str(elsewhere)
    assert acc[acc.index("--config") + 1] == "my.yaml"
    assert acc[acc.index("--output-dir") + 1] == "runs/my-4242"


@pytest.mark.parametrize("env, said", [
    # a CPU node (--gpus-per-node 0) without GPUS_PER_NODE: accelerate got --num_processes 0
    ({"GPUS_PER_NODE": "", "SLURM_GPUS_ON_NODE": "0"}, "got '0' (SLURM_GPUS_ON_NODE=0)"),
    ({"GPUS_PER_NODE": "two"}, "got 'two'"),
    ({"GPUS_PER_NODE": "-1"}, "got '-1'"),
])
def test_slurm_script_refuses_a_rank_count_that_is_not_positive(tmp_path, env, said):
    code, err, srun, acc = _sbatch(tmp_path, [TINY], **env)
    assert code == 2 and not srun and not acc
    assert len(err.strip().splitlines()) == 1 and "GPUS_PER_NODE" in err and said in err, err
    code, err, _, acc = _sbatch(tmp_path, [TINY], GPUS_PER_NODE="", SLURM_GPUS_ON_NODE="4")
    assert code == 0 and acc[acc.index("--num_processes") + 1] == "8", err  # 2 nodes x 4


def test_slurm_script_requeued_finds_its_checkpoints_under_a_directory_with_brackets(tmp_path):
    """The requeue check globbed "$OUTPUT_DIR/checkpoints/step-*" with OUTPUT_DIR unescaped: a
    directory named like runs/exp[1] (glob characters) matched nothing, so a job started from
    --resume PATH and requeued after checkpoints of its own resumed PATH again, which dptrain
    refuses (exit 2, "holds checkpoints after step ...")."""
    branch = tmp_path / "exp[1]"
    (branch / "checkpoints" / "step-00000013").mkdir(parents=True)
    code, err, srun, acc = _sbatch(tmp_path, [TINY, "--resume", "runs/old/checkpoints/step-4"],
                                   SLURM_RESTART_COUNT="1", OUTPUT_DIR=str(branch))
    assert code == 0, err
    assert acc.count("--resume") == 1 and acc[acc.index("--resume") + 1] == "auto", acc


def _slurm_with_a_stub_srun(tmp_path: Path, args: list[str], **slurm: str):
    """slurm.sbatch on the tiny config with ``args``, outside Slurm but for the ``slurm``
    variables, its srun a stub that logs its call: (the process, the stub's log file)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "srun").write_text("#!/usr/bin/env bash\necho srun >> \"$LOG\"\n")
    (stubs / "srun").chmod(0o755)
    log = tmp_path / "srun.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{stubs}:{env['PATH']}", LOG=str(log), DPTRAIN_ROOT=str(ROOT),
               GPUS_PER_NODE="2", **slurm)
    proc = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), TINY, *args],
                          env=env, capture_output=True, text=True, timeout=60)
    return proc, log


def test_slurm_script_run_outside_an_allocation_says_what_is_missing(tmp_path):
    """`bash launch/slurm.sbatch CONFIG` outside Slurm (no SLURM_JOB_NODELIST): the script has
    fallbacks for SLURM_NNODES and SLURM_JOB_ID, but died with bash's "SLURM_JOB_NODELIST:
    unbound variable", exit 1."""
    proc, log = _slurm_with_a_stub_srun(tmp_path, [])
    assert "unbound variable" not in proc.stderr, proc.stderr
    if proc.returncode != 0:  # refused: one line, status 2, nothing launched
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not log.exists()


@pytest.mark.parametrize("arg", [["--output-dir", "runs/x"], ["--output-dir=runs/x"]])
def test_slurm_script_refuses_an_output_dir_argument_for_the_one_its_checks_read(tmp_path,
                                                                                  arg):
    # dptrain takes the last --output-dir, but the requeue's "--resume auto" and the --resume
    # check read OUTPUT_DIR (default runs/<config>-<job id>): a requeued job looked in the
    # wrong directory
    proc, log = _slurm_with_a_stub_srun(tmp_path, arg, SLURM_JOB_NODELIST="node1",
                                        SLURM_JOB_ID="7")
    assert proc.returncode == 2 and "OUTPUT_DIR=DIR" in proc.stderr, proc.stderr
    assert not log.exists()
